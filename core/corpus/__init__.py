"""The bundled corpus, shipped inside the package (setup.cfg [options.package_data]) so that a wheel install finds it
too: austen.txt, Jane Austen's six novels, one sentence a line (public domain; LICENSE.md says where from).
core.defaults.DEFAULT_CORPUS is its path; every default --data / --data.corpus / --data.source is that path.
"""
