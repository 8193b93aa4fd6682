"""Tokenizers: loading one (hub id or local directory), its identity, and embedding it in a checkpoint as data.

    tokenizer = load_tokenizer("roberta-base")          # hub id (org/name@REVISION too) or local directory; fast
    fingerprint(tokenizer)                              # sha256 of its full definition
    files = tokenizer_files(tokenizer); tokenizer_from_files(files)   # {name: text}: JSON and text, never a pickle
    boundary_ids(tokenizer)                             # the ids opening and closing a sequence (<s>, </s>)
    special_strings(tokenizer); special_ids(tokenizer)   # every special token (added ones marked special too)
    unknown_id(tokenizer); unknown_count(ids, mask, id)  # [UNK]: text the vocabulary lacks (None: no such token)
    readable_token(tokenizer, "Ġs")                     # ' s': the text one token stands for, for people
    with truncating_right(tokenizer): tokenizer(texts, truncation=True, max_length=n)   # keeps each text's start
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import warnings
from pathlib import Path

from core.errors import UserError, library_line
from core.sources import cannot_load, check_hub, local_path, pretrained
from core.wording import plural

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, RoBERTa's (fairseq's) order


def load_tokenizer(source: str | Path, mask: bool = True, pad: bool = True):
    """An existing tokenizer by hub id, local directory or a `tokenizers` file (`Tokenizer.save("tok.json")`); it
    must be fast, and have a mask token when `mask` (the MLM objective; a causal one, or an analysis, needs none). A
    bare `tokenizers` file names no token's role: roles are taken from its special tokens' conventional names
    (`name_special_tokens`). With
    `pad` (training), a tokenizer without a pad token of its own (none: GPT-2's, Llama's; or one that is also its
    eos, bos, unk, cls or sep) gets a dedicated one added, with a warning: the model's `pad_token_id` is its zero
    padding row, and RoBERTa's embeddings number positions past it, so no token of a text may be it (the blocks never
    hold it: datamodules.blocks.tokenize_texts)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = local_path(source, "tokenizer")
    if path is not None:
        check_tokenizer_files(path, f"tokenizer {str(source)!r}")
    else:
        check_hub(source, "tokenizer")
    try:
        if path is not None and path.is_file():
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            tokenizer = pretrained(AutoTokenizer, path if path is not None else source)
    except Exception as error:  # OSError, ValueError, and the tokenizers library's plain Exception for a bad file
        raise cannot_load("tokenizer", source, library_line(error)) from None
    name_special_tokens(tokenizer, source)
    if mask and tokenizer.mask_token_id is None:
        raise UserError(f"tokenizer {source} has no mask token, needed for MLM; name it: "
                        "PreTrainedTokenizerFast(tokenizer_file=..., mask_token=...).save_pretrained(DIR)")
    if not tokenizer.is_fast:
        raise UserError(f"tokenizer {source} is not a fast (Rust) tokenizer")
    if pad:
        add_own_pad(tokenizer, source)
    return tokenizer


@contextlib.contextmanager
def truncating_right(tokenizer):
    """Within: `tokenizer` cuts a long text at its end, keeping its start, whatever its own `truncation_side` (a chat
    model's tokenizer may say left, and a tokenizer.json's truncation direction sets it): every sentence is read from
    its first token, as the paper reads it. Restored on exit."""
    side = getattr(tokenizer, "truncation_side", "right")
    tokenizer.truncation_side = "right"
    try:
        yield tokenizer
    finally:
        tokenizer.truncation_side = side


def add_own_pad(tokenizer, source) -> None:
    """A dedicated pad token added (with a warning) when the tokenizer has none, or shares it with another role."""
    pad = tokenizer.pad_token_id
    roles = {getattr(tokenizer, f"{role}_token_id", None): role for role in ("unk", "sep", "cls", "bos", "eos")}
    if pad is not None and pad not in roles:
        return
    vocabulary = tokenizer.get_vocab()
    added = next(name for name in ("<pad>", "[PAD]", "<|pad|>", *(f"<pad_{i}>" for i in range(len(vocabulary) + 1)))
                 if name not in vocabulary)
    why = "has no pad token" if pad is None else f"pads with its {roles[pad]} token {tokenizer.pad_token}"
    tokenizer.add_special_tokens({"pad_token": added})
    warnings.warn(f"tokenizer {source} {why}: added {added} as id {tokenizer.pad_token_id} (the model's "
                  "pad_token_id, which no training block holds)", stacklevel=3)


# the names the `tokenizers` library's own trainers give their special tokens (RoBERTa's and BERT's conventions)
ROLE_NAMES = {"bos_token": ("<s>",), "eos_token": ("</s>",), "cls_token": ("<s>", "[CLS]"), "sep_token": ("</s>", "[SEP]"),
              "unk_token": ("<unk>", "[UNK]"), "pad_token": ("<pad>", "[PAD]"), "mask_token": ("<mask>", "[MASK]")}


def name_special_tokens(tokenizer, source) -> None:
    """A tokenizer that names no special-token role at all (a bare `tokenizers` file: no tokenizer_config.json) gets
    the roles its special tokens' names say (<s> </s> <unk> <pad> <mask>, or [CLS] [SEP] [UNK] [PAD] [MASK]), with one
    warning saying which; a tokenizer that names any role is left as it is. A file that frames its texts already (a
    [CLS] $A [SEP] template) takes the names of its frame's convention only, so that the model's blocks are framed as
    its texts are (a file holding both <s> and [CLS] would otherwise frame blocks <s> ... </s>)."""
    if any(getattr(tokenizer, role, None) is not None for role in ROLE_NAMES):
        return
    special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    frame = framing(tokenizer)
    style = frame[0][:1] if frame and any(frame[0] in names for names in ROLE_NAMES.values()) else None
    named = {}
    for role, names in ROLE_NAMES.items():
        found = next((name for name in names if name in special and style in (None, name[:1])), None)
        if found is not None:
            setattr(tokenizer, role, found)
            named[role.removesuffix("_token")] = found
    if not named:
        return
    roles = ", ".join(f"{role} {token}" for role, token in named.items())
    framed = frame_texts(tokenizer) if not frame else ""
    warnings.warn(f"tokenizer {source} names no special-token roles (a bare tokenizers file); taken from the tokens' "
                  f"names: {roles}{framed}", stacklevel=3)


def special_strings(tokenizer) -> list[str]:
    """Every string `tokenizer` reads as a special token wherever it is written in a text: its named and extra special
    tokens (`all_special_tokens`) and each added token marked special, which `all_special_tokens` leaves out
    (`add_tokens(..., special_tokens=True)`; a hub tokenizer's reserved tokens; a bare `tokenizers` file's unnamed
    ones). The tokenizer splits a text at these before anything else."""
    named = list(getattr(tokenizer, "all_special_tokens", None) or ())
    try:
        added = tokenizer.added_tokens_decoder.values()
    except (AttributeError, NotImplementedError):  # not a transformers tokenizer
        added = ()
    return list(dict.fromkeys([*named, *(str(token) for token in added if getattr(token, "special", False))]))


def special_ids(tokenizer, unknown: bool = True) -> list[int]:
    """The ids of every special token of `tokenizer`, sorted: its named and extra ones (`all_special_ids`: [CLS],
    [SEP], [PAD], [MASK], <s>, </s>, <unk>, its additional special tokens) and each added token marked special, which
    `all_special_ids` leaves out (`add_tokens(..., special_tokens=True)`; a hub tokenizer's reserved tokens: the ids of
    `special_strings`). Without `unknown`, the unknown token's id is left out ([UNK] stands for a word of the text the
    vocabulary lacks: --exclude_special counts it as that word), unless it is also another special token (GPT-2's and
    GPT-NeoX's <|endoftext|> is their unk, bos and eos at once: written between documents, it is their eos, never a
    word). The one list of special ids: masking, the encoder's --exclude_special (and so the attention sinks' special
    tokens and a massive activation's `special`)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    try:
        added = tokenizer.added_tokens_decoder.items()
    except (AttributeError, NotImplementedError):  # not a transformers tokenizer (a benchmark's stand-in)
        added = ()
    ids |= {index for index, token in added if getattr(token, "special", False)}
    if not unknown:
        ids.discard(unknown_id(tokenizer))
    return sorted(int(i) for i in ids if i is not None)


def unknown_id(tokenizer) -> int | None:
    """The id of the token standing for text the vocabulary lacks ([UNK], <unk>), or None: a tokenizer without one, or
    whose unk is also another special token (GPT-2's <|endoftext|>, its bos and eos: a byte-level vocabulary lacks no
    text). Not the pad: a tokenizer that pads with its unk (some Llama exports) still writes [UNK] for an unknown word."""
    unk = getattr(tokenizer, "unk_token_id", None)
    roles = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "sep", "cls", "mask")}
    return None if unk is None or unk in roles else int(unk)


def unknown_count(input_ids, attention_mask, unknown: int | None) -> int:
    """How many of the tokens of a padded batch ([batch, seq] tensors) are the unknown token (`unknown_id`); 0 for a
    tokenizer without one. Padding never counts (a tokenizer may pad with its unk)."""
    return 0 if unknown is None else int(((input_ids == unknown) & attention_mask.bool()).sum())


def unknown_line(unknown: int, tokens: int | None = None, where: str = "the report") -> str:
    """What a report's num_unknown means, in one line (of `tokens` when known): every entry point says it so."""
    share = f"{unknown} of the {plural(tokens, 'token')} ({100 * unknown / tokens:.2g}%)" if tokens else \
        plural(unknown, "token")
    return (f"{share} {'is' if unknown == 1 else 'are'} the tokenizer's unknown token: text its vocabulary lacks (emoji, another script, ...), each "
            f"read as the one unknown token's vector, not as what was written (counted in {where} as num_unknown)")


def lowercases(tokenizer) -> bool:
    """Whether the tokenizer reads a text case-blind (BERT uncased's normaliser lowercases): a capitalised text gets
    the ids of its lowercase form. A cased tokenizer (RoBERTa's, BERT cased's) tells "The" from "the"."""
    text = "The Word"
    return tokenizer(text, add_special_tokens=False)["input_ids"] == \
        tokenizer(text.lower(), add_special_tokens=False)["input_ids"]


def sink_ids(tokenizer) -> list[int]:
    """The special ids whose attention the sinks' special-token mass counts: special_ids without [UNK] (a word of the
    text, as --exclude_special reads it) and without the pad token (padding is never attended). One rule for
    `analyze.py outliers` (analyses/magnitudes.py) and the live AttentionGeometry (the training data's tokenizer)."""
    pad = tokenizer.pad_token_id
    return [i for i in special_ids(tokenizer, unknown=False) if i != pad]


def framing(tokenizer) -> tuple[str, ...]:
    """The tokens the tokenizer adds around a text (its post-processor's template: ("[CLS]", "[SEP]")), () if none."""
    added = tokenizer("a", return_special_tokens_mask=True)
    return tuple(tokenizer.convert_ids_to_tokens([token for token, mask in zip(added["input_ids"],
                                                                               added["special_tokens_mask"]) if mask]))


def frame_texts(tokenizer) -> str:
    """A bare `tokenizers` file adds nothing around a text (no post-processor template), yet the model is trained on
    <s> piece </s> blocks (datamodules/blocks.py): its texts are framed the same way, <s> text </s> (pairs as
    RoBERTa's: <s> a </s></s> b </s>) or [CLS] text [SEP] (pairs as BERT's, the second segment type 1), so the export
    reads sentences as it was trained. What was done, for the warning (called only when nothing frames texts yet)."""
    from tokenizers import processors

    first, last = (tokenizer.bos_token, tokenizer.eos_token) if tokenizer.bos_token is not None \
        else (tokenizer.cls_token, tokenizer.sep_token)
    if first is None or last is None:
        return ""
    pair = f"{first} $A {last} {last} $B {last}" if tokenizer.bos_token is not None else \
        f"{first} $A {last} $B:1 {last}:1"
    ids = [(token, tokenizer.convert_tokens_to_ids(token)) for token in dict.fromkeys((first, last))]
    template = processors.TemplateProcessing(single=f"{first} $A {last}", pair=pair, special_tokens=ids)
    backend = tokenizer.backend_tokenizer
    backend.post_processor = template if backend.post_processor is None else \
        processors.Sequence([backend.post_processor, template])
    return f"; each text framed {first} ... {last}, as the model's blocks are"


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def check_tokenizer_files(directory: Path, what: str) -> None:
    """One line when a local directory holds none of the files a tokenizer is built from (transformers would build
    an empty one from a bare tokenizer_config.json, or fail with a message that ends in "from one of:")."""
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"cannot load {what}: {directory} holds no tokenizer files (tokenizer.json, vocab.json + "
                        "merges.txt, vocab.txt, or a SentencePiece model)")
    if directory.is_dir() and not any((directory / name).is_file()
                                      for name in ("tokenizer.json", "tokenizer_config.json", "config.json")):
        held = " + ".join(name for name in TOKENIZER_FILES[1:] + ("merges.txt",) if (directory / name).is_file())
        raise UserError(f"cannot load {what}: {directory} holds {held} alone, which does not say what tokenizer it "
                        "is (no tokenizer.json, tokenizer_config.json or config.json); save it whole: "
                        "tokenizer.save(\"DIR/tokenizer.json\") (tokenizers) or save_pretrained(DIR) (transformers)")
    if directory.is_file() and directory.suffix.lower() != ".json":
        raise UserError(f"cannot load {what}: {directory} is a file; give the directory holding the tokenizer, or a "
                        "tokenizers file (.json)")


def check_special_ids(tokenizer, name: str) -> None:
    """RoBERTa's ids: <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4."""
    got = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if got != list(range(len(SPECIAL_TOKENS))):
        raise UserError(f"{name} has special ids {dict(zip(SPECIAL_TOKENS, got))}, expected 0..4")


def boundary_ids(tokenizer) -> tuple[int, int]:
    """The ids opening and closing a block: <s> and </s>, or [CLS] and [SEP] for a tokenizer without bos/eos."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return bos, eos


def vocab_limit(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (the rows a model's embedding needs)."""
    return max(tokenizer.get_vocab().values()) + 1


def fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, special tokens, normalisation), without its
    truncation and padding: settings of a call, which transformers rewrites on every call (a sentence-transformers
    tokenizer.json saves max_length 128 and fixed padding; the first call clears them), not the tokenizer's identity."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The files `save_pretrained` writes, as {name: text}, to embed a tokenizer in a checkpoint."""
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        return {path.name: path.read_text(encoding="utf-8") for path in Path(directory).iterdir() if path.is_file()}


def tokenizer_from_files(files: dict[str, str], what: str = "the embedded tokenizer"):
    """Inverse of `tokenizer_files`. The files come from a user's checkpoint: only plain names and text are written
    (no path outside the temporary directory), and a tokenizer that cannot be built from them is one line."""
    from transformers import AutoTokenizer

    if not isinstance(files, dict) or not all(isinstance(name, str) and isinstance(text, str) and
                                              name not in ("", ".", "..") and Path(name).name == name
                                              for name, text in files.items()):
        raise UserError(f"cannot load {what}: its files are not plain names and texts")
    with tempfile.TemporaryDirectory() as directory:
        for name, text in files.items():
            (Path(directory) / name).write_text(text, encoding="utf-8")
        check_tokenizer_files(Path(directory), what)
        try:
            return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
        except Exception as error:  # OSError, ValueError, the tokenizers library's plain Exception
            raise UserError(f"cannot load {what}: {library_line(error)}") from None


SPACE_MARKER = "\u2581"  # SentencePiece's word-start marker, '▁'


def readable_token(tokenizer, token: str) -> str:
    """The text one token stands for, as a person reads it: `convert_tokens_to_string` of it alone (byte-level BPE's
    'Ġs' is ' s', its 'Ċ' a newline, WordPiece's '##ing' stays '##ing'); SentencePiece's '▁the' keeps the leading space
    its decoder drops at the start of a text (' the'). A token that is part of a character (a byte-level BPE byte of a
    longer UTF-8 character) stays as it is, as does one the tokenizer cannot turn into text."""
    try:
        text = tokenizer.convert_tokens_to_string([token])
    except (TypeError, ValueError, KeyError, AttributeError, IndexError):
        return token
    if not isinstance(text, str) or "\ufffd" in text and "\ufffd" not in token:
        return token
    if token.startswith(SPACE_MARKER) and not text.startswith(" "):
        text = " " + text
    return text
