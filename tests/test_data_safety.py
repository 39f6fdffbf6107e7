"""Nothing the user owns is deleted: ``moqe quantize --out`` and the app's Quantize & save refuse any output
folder that is not new, empty, or a bundle this toolkit wrote, and any folder that holds or lies in the
source model. After each refusal every file of the folder, and of the source, is unchanged byte for byte."""
from __future__ import annotations

import os

import hashlib
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
import gradio as gr  # noqa: E402

from test_uqff_support import tiny_checkpoint
from toolkit.cli import main
from toolkit.quant import parse_policy
from toolkit.uqff import save_bundle, spec


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root (links recorded as their target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link->" + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "parent" / "model")


def _user_folder(tmp: Path) -> Path:
    d = tmp / "victim"
    (d / "notes").mkdir(parents=True)
    (d / "thesis.txt").write_text("three years of work")
    (d / "notes" / "a.md").write_text("# notes")
    return d


def _bundle_plus_user_file(tmp: Path, src: Path) -> Path:
    d = tmp / "bundle"
    save_bundle(src, d, parse_policy("moqe", "int4"))
    (d / "mine.txt").write_text("added by the user")
    return d


def _symlink_to_user_folder(tmp: Path) -> Path:
    target = _user_folder(tmp)
    link = tmp / "link"
    link.symlink_to(target)
    return link


def _a_file(tmp: Path) -> Path:
    f = tmp / "file.bin"
    f.write_bytes(b"\x00\x01")
    return f


# (case, make the --out folder from (tmp, source) -> path, protected root, expected message)
REFUSED = [
    ("ordinary-folder", lambda t, s: _user_folder(t), None, r"is not a UQFF bundle written by this toolkit \(it holds notes, thesis\.txt\)"),
    ("model-folder-itself", lambda t, s: s, None, r"is the source checkpoint"),
    ("parent-of-model", lambda t, s: s.parent, None, r"contains the source checkpoint"),
    ("inside-model", lambda t, s: s / "sub", None, r"lies inside the source checkpoint"),
    ("bundle-with-user-file", _bundle_plus_user_file, None, r"also holds mine\.txt that the bundle did not write"),
    ("symlink-to-folder", lambda t, s: _symlink_to_user_folder(t), None, r"is a symbolic link"),
    ("a-file", lambda t, s: _a_file(t), None, r"exists and is not a directory"),
    ("root", lambda t, s: Path("/"), "skip", r"contains the source checkpoint"),
]


@pytest.mark.parametrize("case,make,_,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_cli_refuses_and_keeps_every_byte(source, tmp_path, capsys, case, make, _, message):
    src = tmp_path / "parent" / "model"
    shutil.copytree(source, src)
    out = make(tmp_path, src)
    before_tmp, before_src = snapshot(tmp_path), snapshot(src)
    rc = main(["quantize", "--model", str(src), "--experts", "int4", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err
    assert snapshot(src) == before_src
    assert snapshot(tmp_path) == before_tmp  # the folder, the source and everything beside them


def _app_save(source, root, name):
    """The app's Quantize & save as the page calls it (errors turned into gr.Error by ``friendly``)."""
    from app import handlers
    from app.ui import AppSettings

    settings = AppSettings(model=str(source), output_root=str(root))
    return handlers.friendly(handlers.quantize_save)(settings, None, str(source), "moqe", "int4", name)


def test_app_quantize_refuses_an_ordinary_folder(source, tmp_path):
    root = tmp_path / "out"
    victim = _user_folder(root)
    before = snapshot(root)
    with pytest.raises(gr.Error, match="not a UQFF bundle written by this toolkit"):
        _app_save(source, root, victim.name)
    assert snapshot(root) == before


@pytest.mark.parametrize("name,message", [
    ("x" * 300, "255 bytes"), ("a\x00b", "NUL or control"), ("../escape", "outside the output root"),
    ("/etc", "outside the output root"), ("", "give a bundle directory name")])
def test_app_save_names(source, tmp_path, name, message):
    with pytest.raises(gr.Error, match=message):
        _app_save(source, tmp_path / "out", name)


@pytest.mark.parametrize("case", ["absent", "empty", "our-bundle"])
def test_allowed_outputs_are_written(source, tmp_path, case):
    out = tmp_path / "b"
    if case == "empty":
        out.mkdir()
    if case == "our-bundle":
        save_bundle(source, out, parse_policy("moqe", "int8"))
    save_bundle(source, out, parse_policy("moqe", "int4"))
    files = {p.name for p in out.iterdir()}
    assert spec.REPORT in files and "model-0.uqff" in files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no staging folder left behind


def test_written_files_get_the_mode_of_any_file_the_user_writes(source, tmp_path):
    """A GGUF export and a bundle's files: ``0o666 & ~umask`` (0644 under the usual umask), as
    ``open(path, "w")`` would make them, never the temporary file's 0600."""
    mask = os.umask(0o022)
    os.umask(mask)
    want = 0o666 & ~mask
    gguf, bundle = tmp_path / "model.gguf", tmp_path / "bundle"
    assert main(["export", "--model", str(source), "--gguf", str(gguf), "--experts", "q4_0"]) == 0
    save_bundle(source, bundle, parse_policy("moqe", "int4"))
    files = [gguf, *[p for p in bundle.rglob("*") if p.is_file()]]
    assert len(files) >= 3
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(want)}, modes
