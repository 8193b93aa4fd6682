"""Words of a text: what a word is (WORD), word contexts for self-similarity (§4.1), static word vectors (GloVe, the
STS baseline of §4.3).

    contexts = word_contexts(sentences, num_words=1000, min_sentences=10, seed=0)
    contexts = word_contexts(lambda: iter_texts("glue/sst2"))          # a whole source, streamed (bounded memory)
    contexts = source_contexts("glue/sst2", None, pool=0, num_words=1000, min_sentences=10, seed=0,
                               special_tokens=special_strings(tokenizer),   # "unk" of a literal "<unk>" is no word
                               lowercase=lowercases(tokenizer))             # "The" and "the": one word only if uncased
    words = source_words("glue/sst2", None, 0, 1000, 10, 0)   # the words alone (too few: refused before a model loads),
    contexts = words.contexts(visible)                        # their contexts where the encoder's tokens reach
    vectors, dim = read_static_vectors("glove.840B.300d.txt", vocabulary)   # GloVe text format, only `vocabulary`;
    static_sentence_vector("The cat sat.", vectors, dim)   # words looked up as written ("The" is not "the": SentEval's
                                                           # bag of words over a cased GloVe); lowercase=True: ours
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from core.errors import UserError
from core.wording import plural
from datamodules.text import iter_texts, sample_texts

# letters, with inner apostrophes ("don't"), typographic ones too ("don’t": edited text, unlike the bundled corpus,
# writes U+2019; it split into the words "don" and "t", and every "’s", "’t", "’ll" made the words "s", "t", "ll")
WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")


@dataclass
class WordContexts:
    words: list[str]  # the sampled words (lowercased when `lowercase`, else as written)
    sentences: list[str]  # the sentences to encode
    spans: list[list[tuple[int, int, int]]]  # per sentence: (word id, start, end) of each sampled word in it
    num_candidates: int  # words occurring in at least min_sentences of the pool: the words that qualified
    pool: int  # sentences searched
    contexts_per_word: int
    lowercase: bool = True  # words case-folded (an uncased tokenizer), or as written (a cased one)
    duplicates: int = 0  # sentences of the pool that repeat an earlier one (no other context: left out)


T = TypeVar("T")
Visible = Callable[[list[str]], list[int]]  # sentences -> the leading characters of each the encoder reads
RESERVOIR = 10  # occurrences kept per sampled word, in units of min_sentences (a uniform sample of them)


def word_matches(sentence: str, specials: re.Pattern | None = None) -> Iterator[re.Match]:
    """The WORD matches of `sentence`, none inside a special token written in it (`specials`: `special_pattern`): the
    tokenizer splits the text at those first, so the "unk" of WikiText's "<unk>" (RoBERTa's unknown token) or the
    "mask" of "[MASK]" is no word's token, and a word around one ("madeupwords" with the special "madeupword") is only
    its pieces outside it."""
    if specials is None or (found := specials.search(sentence)) is None:
        yield from WORD.finditer(sentence)
        return
    start = 0
    while found is not None:
        yield from WORD.finditer(sentence, start, found.start())
        start = found.end()
        found = specials.search(sentence, start)
    yield from WORD.finditer(sentence, start)


def special_pattern(special_tokens: Iterable[str]) -> re.Pattern | None:
    """The special-token strings as one pattern, matched as the tokenizers match them: exactly, case and all (BERT
    uncased's "[MASK]" is its mask token, its "[mask]" the word "mask" in brackets; RoBERTa's "<unk>" but not "<UNK>"),
    the longest first where two start at one place; None for none."""
    tokens = sorted({token for token in special_tokens if token}, key=lambda token: (-len(token), token))
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def word_contexts(sentences: list[str] | Callable[[], Iterable[str]], num_words: int = 1000, min_sentences: int = 10,
                  seed: int = 0, pool_option: str | None = None, special_tokens: Iterable[str] = (),
                  lowercase: bool = True, visible: Visible | None = None) -> WordContexts:
    """Sample `num_words` words occurring in at least `min_sentences` sentences and `min_sentences` contexts each:
    `sample_words(...).contexts(visible)`, the words and their contexts at once."""
    return sample_words(sentences, num_words, min_sentences, seed, pool_option, special_tokens,
                        lowercase).contexts(visible)


def sample_words(sentences: list[str] | Callable[[], Iterable[str]], num_words: int = 1000, min_sentences: int = 10,
                 seed: int = 0, pool_option: str | None = None, special_tokens: Iterable[str] = (),
                 lowercase: bool = True, progress: bool = False) -> WordSample:
    """Sample `num_words` words occurring in at least `min_sentences` sentences; their contexts come from
    `WordSample.contexts`, once the encoder that reads them is known.

    `sentences` is a list, or a function giving a fresh iterator over a whole source each time it is called (read in
    streamed passes: count the sentences each word occurs in, here; in `contexts`, find the sentences truncation cuts
    and, when there are some, count again where the words are read; keep a seeded uniform sample of RESERVOIR x
    `min_sentences` occurrences of each sampled word, and fetch the sentences finally drawn). Memory is the
    vocabulary's counts plus num_words x RESERVOIR x min_sentences occurrences, 9 bytes a sentence, and 12 bytes a
    sentence the encoder truncates (`Cuts`).

    A sentence that repeats an earlier one (a boilerplate line, a corpus concatenated twice) is one context, not
    several: its words count once, and only its first copy can be drawn (a pass more, only when there are repeats).
    Drawing a word's contexts among copies gave it identical vectors, and a self-similarity of 1 (`duplicates`).

    Words are letter sequences; a word's context in a sentence is its first occurrence. `lowercase` (the entry points
    pass core.tokenizers.lowercases of the encoder's tokenizer): fold case, as an uncased tokenizer reads the text
    ("The" and "the" one word); False keeps the case, as a cased tokenizer reads it ("The" and "the" two words, each
    its own token vectors), as Ethayarajh's code indexes the words by the tokenizer's own strings (bert-base-cased's
    tokens, spaCy's for ELMo and GPT-2: case kept). Every word gets
    exactly `min_sentences` contexts (the same count for frequent and rare words). Contexts are drawn rarest word
    first, preferring sentences already drawn for other words, so far fewer sentences need encoding (about 2000 for
    1000 words in the bundled corpus, instead of 10000). `pool_option` is the entry point's option that sampled
    `sentences` from a larger source (named when too few words qualify; None: the whole source was searched).
    `special_tokens`: the encoder's tokenizer's special-token strings (core.tokenizers.special_strings: its
    `all_special_tokens` and its added tokens marked special); a word written inside one of them in a sentence ("unk"
    in WikiText's "<unk>") does not occur there (`word_matches`): it would have no token of its own (or the special
    token's). Without them (the default), every WORD match counts. `progress`: a bar over each pass (`passed`).
    """
    specials = special_pattern(special_tokens)
    fold = str.lower if lowercase else str
    passes = sentences if callable(sentences) else (lambda: iter(sentences))
    hashes = array("q")  # each sentence's hash: which ones repeat an earlier one (8 bytes a sentence)

    def hashed() -> Iterator[tuple[str, None]]:
        for sentence in passes():
            hashes.append(hash(sentence))
            yield sentence, None

    counts = word_counts(passed(hashed(), progress, "counting words", None if callable(sentences) else len(sentences)),
                         specials, fold)
    total, repeats = len(hashes), repeated(hashes)
    if repeats is not None:  # a repeated sentence is no other context: its words count once, in its first copy
        counts.subtract(word_counts(((sentence, None) for index, sentence in enumerate(passed(
            passes(), progress, "counting repeated sentences", total)) if repeats[index]), specials, fold))
    words = WordSample(num_words, min_sentences, seed, pool_option, lowercase, total, repeats, passes, specials, [])
    words.candidates = words.qualifying(counts)
    return words


def passed(items: Iterable[T], progress: bool, desc: str, total: int | None = None) -> Iterator[T]:
    """`items`, one pass over a source's sentences, with a progress bar as the encoder's (tqdm on stderr, unit
    sentences, cleared when done; none unless `progress`: analyze.py's --no_progress and rank 0); `total`: the
    sentences when known (a list, or a source after its first pass)."""
    from tqdm.auto import tqdm

    with tqdm(items, total=total, unit="sent", desc=desc, disable=not progress, dynamic_ncols=True,
              leave=False) as bar:
        yield from bar


def word_counts(sentences: Iterable[tuple[str, int | None]], specials: re.Pattern | None, fold: Callable) -> Counter:
    """How many of `sentences` ((text, the characters of it read: None for all)) each word occurs in, where read."""
    counts: Counter[str] = Counter()
    for sentence, limit in sentences:
        counts.update({fold(match.group()) for match in word_matches(sentence, specials)
                       if limit is None or match.end() <= limit})
    return counts


@dataclass
class WordSample:
    """The words `sample_words` found (`candidates`: those in at least `min_sentences` sentences, sorted), before
    their contexts, which `contexts` draws where the encoder reads the sentences."""

    num_words: int
    min_sentences: int
    seed: int
    pool_option: str | None
    lowercase: bool
    pool: int  # sentences searched
    repeats: np.ndarray | None  # [pool] bool: a sentence that repeats an earlier one
    passes: Callable[[], Iterable[str]]
    specials: re.Pattern | None
    candidates: list[str]

    @property
    def words(self) -> list[str]:
        """The `num_words` words drawn (seeded) among the candidates."""
        return random.Random(self.seed).sample(self.candidates, self.num_words)

    @property
    def num_candidates(self) -> int:
        return len(self.candidates)

    @property
    def duplicates(self) -> int:
        return 0 if self.repeats is None else int(self.repeats.sum())

    def qualifying(self, counts: Counter, truncated: int = 0) -> list[str]:
        """The words of `counts` in at least `min_sentences` sentences, sorted; too few is one line (`truncated`: the
        sentences truncation cut, whose words past the cut were not counted)."""
        candidates = sorted(word for word, count in counts.items() if count >= self.min_sentences)
        if len(candidates) < self.num_words:
            more = "a larger source" if self.pool_option is None else \
                f"a larger source, or {self.pool_option} 0 to search all of it"
            distinct = f"{self.pool - self.duplicates} distinct sentences ({self.duplicates} more repeat them)" \
                if self.duplicates else plural(self.pool, "sentence")
            where = (f" where the encoder reads them ({plural(truncated, 'sentence was', 'sentences were')} truncated "
                     "at --max_length, and the words past the cut have no vector)") if truncated else ""
            longer = ", a larger --max_length" if truncated else ""
            raise UserError(f"only {plural(len(candidates), 'word')} occur in at least {self.min_sentences} of the "
                            f"{distinct}{where}; self-similarity needs {self.num_words} (fewer words: --num_words, "
                            f"fewer contexts per word: --min_sentences{longer}, or more sentences: {more})")
        return candidates

    def contexts(self, visible: Visible | None = None, progress: bool = False) -> WordContexts:
        """`min_sentences` contexts of each word where the encoder reads it: `visible`, given a list of sentences,
        says how many leading characters of each its tokens cover (where truncation to the encoder's --max_length
        cuts a long one; None: every sentence whole). An occurrence past the cut has no vector: drawn, it was lost,
        and a long sentence, holding many words, was the one the draw preferred. When truncation cuts sentences, the
        words are counted again where they are read (a pass more) and drawn among those that still qualify.
        `progress`: a bar over each pass (the sentences `visible` reads, the counts, the draw)."""
        fold = str.lower if self.lowercase else str
        # sentence -> characters read
        cut = Cuts() if visible is None else truncated(self.passes(), visible, progress, self.pool)
        sample = self
        if cut:
            sample = replace(self, candidates=self.qualifying(word_counts(
                ((sentence, cut.get(index)) for index, sentence in enumerate(self.read(progress, "counting words read"))
                 if self.repeats is None or not self.repeats[index]), self.specials, fold), len(cut)))
        return sample.draw(cut, progress)

    def read(self, progress: bool = False, desc: str = "reading sentences") -> Iterator[str]:
        """One pass over the sentences, with a bar (`progress`; `passed`)."""
        return passed(self.passes(), progress, desc, self.pool)

    def draw(self, cut: Cuts, progress: bool = False) -> WordContexts:
        """Each word's contexts among its occurrences before the `cut` (sentence index -> characters read)."""
        rng = random.Random(self.seed)
        words, min_sentences, fold = rng.sample(self.candidates, self.num_words), self.min_sentences, \
            str.lower if self.lowercase else str
        ids = {word: word_id for word_id, word in enumerate(words)}
        size = RESERVOIR * min_sentences
        kept: list[list[tuple[int, int, int]]] = [[] for _ in words]
        seen = [0] * len(words)
        for index, sentence in enumerate(self.read(progress, "drawing contexts")):
            if self.repeats is not None and self.repeats[index]:
                continue
            first, limit = set(), cut.get(index, len(sentence))
            for match in word_matches(sentence, self.specials):
                word = fold(match.group())
                word_id = ids.get(word)
                if word_id is None or word_id in first:
                    continue
                first.add(word_id)  # its first occurrence is the context: past the cut, the sentence has none
                if match.end() > limit:
                    continue
                place, seen[word_id] = (index, match.start(), match.end()), seen[word_id] + 1
                if seen[word_id] <= size:
                    kept[word_id].append(place)
                elif (slot := rng.randrange(seen[word_id])) < size:  # Algorithm R
                    kept[word_id][slot] = place
        chosen: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for word_id in sorted(range(len(words)), key=lambda w: (seen[w], words[w])):
            places = kept[word_id]
            drawn = [p for p in places if p[0] in chosen]
            rng.shuffle(drawn)
            if len(drawn) < min_sentences:
                fresh = [p for p in places if p[0] not in chosen]
                drawn += rng.sample(fresh, min_sentences - len(drawn))
            for index, start, end in drawn[:min_sentences]:
                chosen[index].append((word_id, start, end))
        order = sorted(chosen)
        texts = [sentence for index, sentence in enumerate(self.read(progress, "reading the contexts drawn"))
                 if index in chosen]
        if len(texts) != len(order) or any(fold(texts[i][s:e]) != words[w] for i, index in enumerate(order)
                                           for w, s, e in chosen[index]):
            raise UserError("the self-similarity source changed while it was read (its passes differ)")
        return WordContexts(words, texts, [chosen[i] for i in order], self.num_candidates, self.pool,
                            min_sentences, self.lowercase, self.duplicates)


LIMIT_CHUNK = 256  # sentences `visible` is asked about at once


class Cuts:
    """The characters the encoder reads of each sentence it does not read whole, by sentence index (added in rising
    order): two arrays, 12 bytes a cut sentence where a dict spends ~100 (a streamed source of long paragraphs)."""

    def __init__(self) -> None:
        self.index, self.limit = array("q"), array("i")

    def add(self, index: int, limit: int) -> None:
        if self.index and index <= self.index[-1]:
            raise ValueError(f"sentence {index} added after sentence {self.index[-1]}")
        self.index.append(index)
        self.limit.append(limit)

    def get(self, index: int, default: int | None = None) -> int | None:
        at = bisect.bisect_left(self.index, index)
        return self.limit[at] if at < len(self.index) and self.index[at] == index else default

    def __len__(self) -> int:
        return len(self.index)


def truncated(sentences: Iterable[str], visible: Visible, progress: bool = False, total: int | None = None) -> Cuts:
    """The characters the encoder reads of each sentence it does not read whole (`Cuts`), `visible` asked a chunk at
    a time (`progress`: a bar, the sentences counted, of `total` when known: a whole source is tokenised)."""
    from tqdm.auto import tqdm

    cut, start, iterator = Cuts(), 0, iter(sentences)
    with tqdm(total=total, unit="sent", desc="sentences the encoder reads", disable=not progress, leave=False) as bar:
        while chunk := list(itertools.islice(iterator, LIMIT_CHUNK)):
            for index, (sentence, limit) in enumerate(zip(chunk, visible(chunk), strict=True), start):
                if limit < len(sentence):
                    cut.add(index, limit)
            start += len(chunk)
            bar.update(len(chunk))
    return cut


def repeated(hashes: array) -> np.ndarray | None:
    """Where a sentence repeats an earlier one, by their hashes ([sentences] bool; None when none does)."""
    values = np.frombuffer(hashes, dtype=np.int64) if len(hashes) else np.zeros(0, dtype=np.int64)
    first = np.unique(values, return_index=True)[1]
    if len(first) == len(values):
        return None
    repeats = np.ones(len(values), dtype=bool)
    repeats[first] = False
    return repeats


def source_contexts(source: str, column: str | None, pool: int, num_words: int, min_sentences: int, seed: int,
                    pool_option: str = "--pool_sentences", special_tokens: Iterable[str] = (), lowercase: bool = True,
                    visible: Visible | None = None) -> WordContexts:
    """`source_words(...).contexts(visible)`: the words of `source` and their contexts at once."""
    return source_words(source, column, pool, num_words, min_sentences, seed, pool_option, special_tokens,
                        lowercase).contexts(visible)


def source_words(source: str, column: str | None, pool: int, num_words: int, min_sentences: int, seed: int,
                 pool_option: str = "--pool_sentences", special_tokens: Iterable[str] = (), lowercase: bool = True,
                 progress: bool = False) -> WordSample:
    """`sample_words` of the sentences of `source` (a file, directory or datasets name): all of them, streamed, when
    `pool` is 0 (the default: the paper's words of a whole training set), else a seeded sample of `pool` of them
    (`pool_option`: the entry point's option for `pool`, named when the sample is too small; `special_tokens`,
    `lowercase`, `progress`: as in `sample_words`)."""
    if pool:
        sentences = sample_texts(iter_texts(source, column), pool, seed)
        return sample_words(sentences, num_words, min_sentences, seed, pool_option if len(sentences) == pool else None,
                            special_tokens, lowercase, progress)
    return sample_words(lambda: iter_texts(source, column), num_words, min_sentences, seed,
                        special_tokens=special_tokens, lowercase=lowercase, progress=progress)


# ---------------------------------------------------------------- static vectors


def read_static_vectors(path: str, vocabulary: set[str], progress: bool = False,
                        lowercase: bool = False) -> tuple[dict[str, Tensor], int]:
    """Vectors of the `vocabulary` words from a GloVe-format text file (`word v1 ... vd` a line; a word2vec header
    line `count dim` is skipped), streamed so only those words are kept.

    A file's word is matched as written, case included (SentEval's get_wordvec, whose bag-of-words GloVe baseline STS
    papers report; a word written twice: its last line, as there). With `lowercase` (ours, not SentEval's) each file
    word is lowercased and the first of its case variants kept (GloVe 840B is cased, most frequent first)."""
    from tqdm.auto import tqdm

    file = Path(path)
    if not file.is_file():
        raise UserError(f"static vectors file not found: {path}")
    vectors, dim = {}, None
    with file.open("rb") as raw, tqdm(total=file.stat().st_size, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"reading {file.name}", leave=False) as bar:
        for number, binary in enumerate(raw, 1):
            bar.update(len(binary))
            line = binary.decode("utf-8-sig" if number == 1 else "utf-8", errors="replace")
            fields = line.rstrip().split(" ")
            if number == 1 and len(fields) == 2 and all(f.isdigit() for f in fields):
                continue
            if len(fields) < 2:
                continue
            if dim is None:
                dim = len(fields) - 1
            elif len(fields) - 1 < dim:
                raise UserError(f"{path}:{number}: {plural(len(fields) - 1, 'value')}, expected {dim} as on the first line")
            word = " ".join(fields[:-dim])  # a few GloVe 840B words contain spaces
            word = word.lower() if lowercase else word
            if word in vocabulary and not (lowercase and word in vectors):
                try:
                    vectors[word] = torch.tensor([float(v) for v in fields[-dim:]])
                except ValueError:
                    raise UserError(f"{path}:{number}: not a GloVe-format line (word followed by numbers)") from None
    if dim is None:
        raise UserError(f"static vectors file has no vectors: {path}")
    if not vectors:
        raise UserError(f"none of the {len(vocabulary)} words of the pairs is in {path}")
    return vectors, dim


def static_sentence_vector(sentence: str, vectors: dict[str, Tensor], dim: int, lowercase: bool = False) -> Tensor:
    """Mean of the static vectors of the sentence's words, each as written ("The" and "the" two words; `lowercase`:
    lowercased, ours), every occurrence counted; zero when none is known (SentEval's bag of words): [dim]."""
    known = [vectors[w] for w in words_of(sentence, lowercase) if w in vectors]
    return torch.stack(known).mean(0) if known else torch.zeros(dim)


def sentence_words(sentence: str, lowercase: bool = False) -> set[str]:
    """The sentence's distinct words (WORD), as written or, with `lowercase`, lowercased."""
    return set(words_of(sentence, lowercase))


def words_of(sentence: str, lowercase: bool = False) -> list[str]:
    return [match.group().lower() if lowercase else match.group() for match in WORD.finditer(sentence)]
