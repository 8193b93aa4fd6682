"""Readers for the semantic evaluations' pairs: WiC (§4.2) and STS (§4.3).

    items, skipped = read_wic("wic/dev.jsonl")                 # SuperGLUE WiC jsonl (or csv/tsv, `super_glue/wic`)
    items, skipped = read_wic("WiC/dev/dev.data.txt")          # original WiC release: data + dev.gold.txt beside it
    pairs = read_sts("sts-test.tsv", score_range=(0, 5))       # columns sentence1, sentence2, score
    pairs = read_sts("stsb")                                   # presets: stsb, sickr, sts12..sts16 (`datasets`)
    pairs = read_sts("STS.input.MSRpar.txt")                   # SentEval STS12-16: STS.gs.MSRpar.txt beside it

Every problem with the input is a UserError naming the file and row. A WiC target that is not where its offsets
say is not an error: the item is skipped and counted. Sentences are cleaned as every text is read
(datamodules/characters.py: NULs dropped with one warning a source, a leading byte-order mark and surrounding whitespace
stripped), WiC's offsets moved with them; an STS sentence with nothing visible is refused, a WiC one skipped.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from core.defaults import STS_PRESETS  # name -> (datasets source, rows kept): core/defaults.py
from core.errors import UserError
from core.wording import plural
from datamodules.characters import clean_text, text_value, text_value_offsets
from datamodules.text import iter_records, read_split
from datamodules.words import WORD

STS_COLUMNS = {
    "sentence1": ("sentence1", "sentence_a", "sentence_A", "text1", "s1"),
    "sentence2": ("sentence2", "sentence_b", "sentence_B", "text2", "s2"),
    "score": ("score", "label", "relatedness_score", "similarity_score", "gold"),
}
# The paper's WiC (§4.2, footnote 5): the SuperGLUE training set, 5,428 pairs (its 638-pair validation set is too small).
WIC_PRESETS = {"wic": "super_glue:wic:train"}
VOWELS = "aeiou"
TRUE_LABELS, FALSE_LABELS = {"true", "t", "1", "yes"}, {"false", "f", "0", "no"}
MAX_EXAMPLES = 10


@dataclass
class WicItem:
    index: int  # row in the source (0-based)
    word: str
    sentence1: str
    sentence2: str
    span1: tuple[int, int]  # character offsets [start, end) of the target in sentence1
    span2: tuple[int, int]
    label: bool  # True: same sense
    pos: str | None = None  # part of speech when the source gives it (WiC: "N" or "V"), else None


@dataclass
class StsPair:
    index: int
    sentence1: str
    sentence2: str
    score: float


@dataclass
class Skipped:
    """Items left out, counted, with a few examples for the report."""

    count: int = 0
    examples: list[dict] = field(default_factory=list)

    def add(self, **example) -> None:
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(example)

    def to_dict(self) -> dict:
        return {"count": self.count, "examples": self.examples}


# ---------------------------------------------------------------- WiC


def read_wic(source: str, gold: str | None = None) -> tuple[list[WicItem], Skipped]:
    """WiC items with their targets at the given offsets; the others are skipped and counted. `source` "wic" is the
    paper's (WIC_PRESETS: SuperGLUE's training split)."""
    source = WIC_PRESETS.get(source, source)
    rows = _original_wic(Path(source), gold) if _is_original_wic(source) else _superglue_wic(source)
    items, skipped = [], Skipped()
    for index, row in enumerate(rows):
        item = _wic_item(index, row, source)
        problems = [f"sentence{n}: {why}" for n, sentence, span in ((1, item.sentence1, item.span1),
                                                                     (2, item.sentence2, item.span2))
                    if (why := target_problem(sentence, item.word, span, item.pos))]
        if problems:
            skipped.add(index=index, word=item.word, reason="; ".join(problems))
        else:
            items.append(item)
    if not items:
        raise UserError(f"no WiC item of {source} has its target word at its offsets ({skipped.count} skipped)")
    return items, skipped


def wic_source(source: str) -> dict:
    """{"data": what is read, "split": the split read (None: a whole file)} of a WiC source, for the reports."""
    data = WIC_PRESETS.get(source, source)
    return {"data": data, "split": None if _is_original_wic(data) else read_split(data)}


def scorable_wic(source: str, gold: str | None = None) -> tuple[list[WicItem], Skipped]:
    """`read_wic` for the WiC protocol, which needs two pairs at least: a threshold chosen on one pair is that pair's
    label, no accuracy at all."""
    items, skipped = read_wic(source, gold)
    if len(items) < 2:
        raise UserError(f"WiC needs at least 2 scorable pairs, but only 1 item of {source} has its target word at "
                        f"its offsets ({skipped.count} skipped)")
    return items, skipped


def target_problem(sentence: str, word: str, span: tuple[int, int], pos: str | None = None) -> str | None:
    """Why `span` does not hold the target `word` (None when it does).

    The span must be one whole word of the sentence (non-empty, in range, not cutting a word, no space inside).
    WiC gives the lemma ("carry") and the span the inflected form ("carried"). A span whose word does not start with
    the lemma's first two letters is misplaced only when another whole word of the sentence is a regular inflection
    of the lemma for its part of speech `pos` (regular_forms: "carries", "carried", ...), i.e. the target is
    elsewhere; otherwise it is an irregular form ("went" for "go", even beside "good"; "ran" beside "runner") and kept.
    """
    start, end = span
    if not sentence:
        return "blank (nothing visible in it)"
    if not 0 <= start < end <= len(sentence):
        return f"offsets {start}-{end} outside the sentence ({len(sentence)} characters)"
    text = sentence[start:end]
    inside = start > 0 and sentence[start - 1].isalnum() or end < len(sentence) and sentence[end].isalnum()
    if inside or not text.strip() or any(c.isspace() for c in text.strip()):
        return f"offsets {start}-{end} ({text!r}) are not one whole word"
    lemma = word.strip().lower()
    if lemma and not text.strip().lower().startswith(lemma[:2]):
        forms = regular_forms(lemma, pos)
        elsewhere = [m.group() for m in WORD.finditer(sentence)
                     if (m.end() <= start or m.start() >= end) and m.group().lower() in forms]
        if elsewhere:
            return f"offsets {start}-{end} hold {text!r}, not {word!r} (which is at {elsewhere[0]!r})"
    return None


def regular_forms(lemma: str, pos: str | None = None) -> set[str]:
    """The lemma and its regular inflections: a noun's plural (+ s, es); a verb's third person, past and participles
    (+ s, es, ed, ing); both for any other `pos` (WiC's "N" and "V"; None: unknown). No derivations (+ er, est, ly:
    "drive" -> "driver" is another word). Spelling: + es only after s, x, z, ch, sh or o; a silent final e (after a
    consonant, with a vowel before it: "make", not "be" or "see") takes + d and is dropped before -ing ("making");
    a final consonant after one vowel is doubled ("stopped"); a final y after a consonant turns to i before -es and
    -ed ("carries", "carried").
    """
    lemma = lemma.lower()
    consonant_y = len(lemma) > 1 and lemma.endswith("y") and lemma[-2] not in VOWELS
    forms = {lemma, lemma + "s"}
    if lemma.endswith(("s", "x", "z", "ch", "sh", "o")):  # "boxes", "goes" (not "bees" for "be")
        forms.add(lemma + "es")
    if consonant_y:
        forms.add(lemma[:-1] + "ies")
    if (pos or "").strip().upper()[:1] == "N":
        return forms
    forms |= {lemma + "ed", lemma + "ing"}
    if consonant_y:
        forms.add(lemma[:-1] + "ied")
    silent_e = lemma.endswith("e") and lemma[-2:-1] not in ("", *VOWELS) and any(c in VOWELS + "y" for c in lemma[:-2])
    if silent_e:
        forms |= {lemma + "d", lemma[:-1] + "ing"}
    consonant_vowel_consonant = lemma[-2:-1] in tuple(VOWELS) and lemma[-1] not in VOWELS + "wxy" and (
        len(lemma) < 3 or lemma[-3] not in VOWELS)
    if consonant_vowel_consonant:
        forms |= {lemma + lemma[-1] + suffix for suffix in ("ed", "ing")}
    return forms


def _is_original_wic(source: str) -> bool:
    return Path(source).is_file() and Path(source).suffix.lower() == ".txt"


def _original_wic(path: Path, gold: str | None) -> Iterator[dict]:
    """The original WiC release: `x.data.txt` (word, PoS, i-j token indices, sentence1, sentence2) + `x.gold.txt`."""
    gold_path = Path(gold) if gold else path.with_name(path.name.replace(".data.", ".gold."))
    if gold_path == path or not gold_path.is_file():
        raise UserError(f"no gold file for {path} (expected {gold_path}; pass --gold)")
    data = _lines(path)
    labels = [line.strip() for line in _lines(gold_path)]
    if len(data) != len(labels):
        raise UserError(f"{path} has {plural(len(data), 'pair')} but {gold_path} has {plural(len(labels), 'label')}")
    for number, (line, label) in enumerate(zip(data, labels), 1):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != 5:
            raise UserError(f"{path}:{number}: expected 5 tab-separated fields (word, PoS, i-j, s1, s2), "
                            f"got {len(fields)}")
        word, pos, indices, sentence1, sentence2 = fields
        try:
            token1, token2 = (int(i) for i in indices.split("-"))
        except ValueError:
            raise UserError(f"{path}:{number}: token indices {indices!r} are not i-j") from None
        yield {"word": word, "pos": pos, "sentence1": sentence1, "sentence2": sentence2, "label": label,
               **_token_span(sentence1, token1, "1"), **_token_span(sentence2, token2, "2")}


def _token_span(sentence: str, token: int, which: str) -> dict:
    """Character offsets of the token-th whitespace token ((-1, -1) when there is none: skipped later)."""
    tokens = list(re.finditer(r"\S+", sentence))
    if not 0 <= token < len(tokens):
        return {f"start{which}": -1, f"end{which}": -1}
    match = tokens[token]
    text = match.group()
    core = re.search(r"[\w'\0-]+", text)  # the word without punctuation stuck to it ("bank," -> "bank"); a NUL in it
    # (dropped later, the offsets moved with it: _wic_item) is no punctuation
    start = match.start() + (core.start() if core else 0)
    return {f"start{which}": start, f"end{which}": start + (len(core.group()) if core else len(text))}


def _superglue_wic(source: str) -> Iterator[dict]:
    for row in iter_records(source):
        missing = [key for key in ("word", "sentence1", "sentence2", "start1", "end1", "start2", "end2", "label")
                   if key not in row]
        if missing:
            raise UserError(f"{source} is not in WiC format: missing {missing} (columns: {sorted(row)})")
        yield row


def _wic_item(index: int, row: dict, source: str) -> WicItem:
    """The item of a row, its sentences and word cleaned as every text is read (datamodules/characters.py: NULs
    dropped with one warning a source, a leading byte-order mark and surrounding whitespace stripped, nothing visible:
    blank) and its offsets moved with the characters dropped before or inside the target, onto the same word."""
    try:
        spans = [(int(row[f"start{n}"]), int(row[f"end{n}"])) for n in (1, 2)]
    except (TypeError, ValueError):
        raise UserError(f"{source} row {index}: offsets are not integers") from None
    sentences = []
    for n, (start, end) in zip((1, 2), spans):
        raw = _field(row[f"sentence{n}"])
        text, offset = text_value_offsets(raw, source)
        inside = 0 <= start < end <= len(raw)  # else kept as given: target_problem says they lie outside the sentence
        sentences.append((text, (offset(start), offset(end)) if inside else (start, end)))
    pos = row.get("pos")  # the original release's PoS column; SuperGLUE's files carry none (unknown)
    (sentence1, span1), (sentence2, span2) = sentences
    return WicItem(index, text_value(_field(row["word"]), source), sentence1, sentence2, span1, span2,
                   _label(row["label"], source, index), str(pos) if pos not in (None, "") else None)


def _field(value) -> str:
    """A field's text: "" for a missing value (a `datasets` cell's None), a number's digits."""
    return "" if value is None else str(value)


def _label(value, source: str, index: int) -> bool:
    text = clean_text(str(value)).lower()  # a byte-order mark of files joined with cat too
    if text in TRUE_LABELS:
        return True
    if text in FALSE_LABELS:
        return False
    if text == "-1":
        raise UserError(f"{source} row {index} has no label (-1: an unlabelled test split?)")
    raise UserError(f"{source} row {index}: label {value!r} is not true/false (T/F, 1/0)")


# ---------------------------------------------------------------- STS


def read_sts(source: str, gold: str | None = None, score_range: tuple[float, float] = (0.0, 5.0)
             ) -> tuple[list[StsPair], int]:
    """STS pairs and the number of pairs without a gold score (SentEval's blank gold lines; left out).

    Every score must lie in `score_range` (0-5 for STS-B and STS12-16, 1-5 for SICK-R).
    """
    low, high = score_range
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".txt":
        rows = _column_sts(str(path), records=_sick_records(path)) if _is_sick(path) else _senteval_sts(path, gold)
    else:
        rows = _column_sts(*STS_PRESETS.get(source, (source, {})))
    pairs, unscored = [], 0
    for index, (sentence1, sentence2, raw) in enumerate(rows):
        if raw is None or clean_text(str(raw)) == "":
            unscored += 1
            continue
        try:
            score = float(clean_text(raw) if isinstance(raw, str) else raw)  # a byte-order mark of cat-joined files
        except (TypeError, ValueError):
            raise UserError(f"{source} pair {index}: score {raw!r} is not a number") from None
        if not (math.isfinite(score) and low <= score <= high):
            raise UserError(f"{source} pair {index}: score {score:g} is outside the declared range "
                            f"{low:g}-{high:g} (--score_range){' (unlabelled test split?)' if score < 0 else ''}")
        # cleaned as every text is read (datamodules/characters.py): NULs dropped (one warning a source), a leading
        # byte-order mark and surrounding whitespace stripped; a sentence with nothing visible is empty
        sentence1, sentence2 = (text_value(_field(sentence), source) for sentence in (sentence1, sentence2))
        if not sentence1 or not sentence2:
            raise UserError(f"{source} pair {index} has an empty sentence (nothing visible in it)")
        pairs.append(StsPair(index, sentence1, sentence2, score))
    if not pairs:
        raise UserError(f"no scored pairs in {source}")
    if len(pairs) < 3:
        warnings.warn(f"{source} has only {plural(len(pairs), 'scored pair')}: a Spearman "
                      f"correlation needs at least 3 to mean anything" +
                      ("; every value is reported as null" if len(pairs) == 1 else ""), stacklevel=2)
    elif len({pair.score for pair in pairs}) == 1:
        warnings.warn(f"the gold scores of {source} are all {pairs[0].score:g}: Spearman correlation is undefined "
                      "for constant scores; every value is reported as null", stacklevel=2)
    return pairs, unscored


def _senteval_sts(path: Path, gold: str | None) -> Iterator[tuple[str, str, str | None]]:
    gold_path = Path(gold) if gold else path.with_name(path.name.replace("input", "gs"))
    if gold_path == path or not gold_path.is_file():
        raise UserError(f"no gold file for {path} (expected {gold_path}; pass --gold)")
    data, scores = _lines(path), _lines(gold_path)
    if len(data) != len(scores):
        raise UserError(f"{path} has {plural(len(data), 'pair')} but {gold_path} has {plural(len(scores), 'score')}")
    for number, (line, score) in enumerate(zip(data, scores), 1):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) < 2:
            raise UserError(f"{path}:{number}: expected two tab-separated sentences")
        yield fields[0], fields[1], score.strip() or None


def _is_sick(path: Path) -> bool:
    """SICK's own release format (SemEval-2014 Task 1, as SentEval's SICK_*.txt): a tab-separated header row with
    sentence_A, sentence_B and relatedness_score."""
    with path.open(encoding="utf-8-sig", errors="replace") as handle:
        header = handle.readline().rstrip("\r\n").split("\t")
    return {"sentence_A", "sentence_B", "relatedness_score"} <= set(header)


def _sick_records(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8-sig", newline="") as handle:
        yield from csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)


def _column_sts(source: str, where: dict | None = None, records: Iterator[dict] | None = None
                ) -> Iterator[tuple[str, str, object]]:
    """(sentence1, sentence2, score) of a table with those columns (or their aliases, STS_COLUMNS); `where` keeps the
    rows whose columns have the given values (when the table has those columns)."""
    names = None
    for row in records if records is not None else iter_records(source):
        if any(column in row and row[column] != value for column, value in (where or {}).items()):
            continue
        if names is None:
            names = {}
            for role, candidates in STS_COLUMNS.items():
                names[role] = next((c for c in candidates if c in row), None)
            missing = [role for role, name in names.items() if name is None]
            if missing:
                raise UserError(f"{source} has no {'/'.join(missing)} column (columns: {sorted(row)}); expected "
                                "sentence1, sentence2, score")
        yield row[names["sentence1"]], row[names["sentence2"]], row[names["score"]]


def _lines(path: Path) -> list[str]:
    try:
        # split at \n (and \r\n) only: str.splitlines also splits at U+2028, U+0085, \x0b, \x0c ... inside a sentence
        # of web text, which shifted every later pair against its gold score
        lines = [line.rstrip("\r") for line in path.read_text(encoding="utf-8-sig").split("\n")]
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise UserError(f"data file is empty: {path}")
    return lines
