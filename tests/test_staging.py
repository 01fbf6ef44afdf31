"""Outputs that appear whole or not at all (``lightning_hetermoe.staging``): what a failed or
stopped run leaves, for a file (a consolidated checkpoint) and a directory (a prepared corpus,
a Hugging Face export)."""

from __future__ import annotations

import os
import tempfile

import pytest

from lightning_hetermoe.staging import PARTIAL, StagedDirectory, StagedFile, partial_sibling, replace_directory


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_file_replaces_the_old_one_only_when_it_is_whole(tmp_path):
    out = tmp_path / "model.ckpt"
    out.write_bytes(b"the old checkpoint")
    with pytest.raises(KeyboardInterrupt):
        with StagedFile(out) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(f".model.ckpt{PARTIAL}")
            tmp.write_bytes(b"half of the new")
            raise KeyboardInterrupt  # a Ctrl-C in the middle of the write
    assert out.read_bytes() == b"the old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    with StagedFile(out) as tmp:
        tmp.write_bytes(b"the new checkpoint")
        assert out.read_bytes() == b"the old checkpoint"  # until the block ends
    assert out.read_bytes() == b"the new checkpoint"
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_a_failure_removes_the_parents_it_made_and_no_others(tmp_path):
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "a" / "b" / "out.ckpt"
    with pytest.raises(RuntimeError, match="disk full"):
        with StagedFile(out) as tmp:
            assert (tmp_path / "kept" / "a" / "b").is_dir()
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    with pytest.MonkeyPatch.context() as mp:  # the partial copy itself cannot be made (a full disk)
        mp.setattr(tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space left"):
            StagedFile(out)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    with StagedFile(out) as tmp:
        tmp.write_bytes(b"x")
    assert out.read_bytes() == b"x"


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(IsADirectoryError, match="it is a directory"):
        StagedFile(tmp_path / "a_dir")
    with pytest.raises(NotADirectoryError, match="it is a file"):
        StagedDirectory(tmp_path / "a_file")
    with pytest.raises(OSError):
        StagedFile(tmp_path / "a_file" / "below")  # a parent that is a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]


def test_a_new_directory_is_renamed_into_place_with_the_usual_mode(tmp_path):
    out = tmp_path / "corpus"
    with StagedDirectory(out) as tmp:
        (tmp / "tokens.bin").write_bytes(b"123")
        assert not out.exists()
    assert (out / "tokens.bin").read_bytes() == b"123"
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_into_a_directory_already_there_the_files_move_in_the_named_ones_last(tmp_path, monkeypatch):
    out = tmp_path / "export"
    out.mkdir()
    for name, text in (("config.json", "old config"), ("index.json", "old index"), ("shard-1", "old shard"),
                       ("notes.txt", "the user's")):
        (out / name).write_text(text)
    (out / "logs").mkdir()
    (out / "logs" / "old.log").write_text("old")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError):
        with StagedDirectory(out, last=("index.json", "config.json")) as tmp:
            (tmp / "shard-1").write_text("new shard")
            raise ValueError("stopped half-way")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real_replace(a, b)))
    with StagedDirectory(out, last=("index.json", "config.json")) as tmp:
        for name in ("config.json", "index.json", "shard-1", "shard-2"):
            (tmp / name).write_text(f"new {name}")
        (tmp / "logs").mkdir()
        (tmp / "logs" / "new.log").write_text("new")
    assert moved == ["logs", "shard-1", "shard-2", "index.json", "config.json"]
    assert {p.name: p.read_text() for p in out.rglob("*") if p.is_file()} == {
        "config.json": "new config.json", "index.json": "new index.json", "shard-1": "new shard-1",
        "shard-2": "new shard-2", "notes.txt": "the user's", "new.log": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.mark.parametrize("swap", ["exchange", "aside"])
@pytest.mark.parametrize("old", ["directory", "file", "nothing"])
def test_a_directory_replaces_whatever_had_its_name_whole(tmp_path, monkeypatch, swap, old):
    """A sharded checkpoint saved again under its name: the new directory in one step where
    the system swaps two names (else the old one moved aside first), none of the old files
    left among the new (an earlier save's pieces, or a single-file checkpoint of the name)."""
    from lightning_hetermoe import staging

    if swap == "aside":
        monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    out = tmp_path / "last.ckpt"
    if old == "directory":
        out.mkdir()
        (out / "__3_0.distcp").write_text("a piece of a 4-rank save")
        (out / "meta.pt").write_text("old meta")
    elif old == "file":
        out.write_text("a single-file checkpoint")
    staged = partial_sibling(out)
    assert staged.parent == tmp_path and staged.name.startswith(f".last.ckpt{PARTIAL}") and not staged.exists()
    staged.mkdir()
    (staged / "meta.pt").write_text("new meta")
    (staged / "__0_0.distcp").write_text("new piece")
    replace_directory(staged, out)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"meta.pt": "new meta", "__0_0.distcp": "new piece"}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_the_next_write_of_an_output_removes_what_a_killed_one_left_beside_it(tmp_path):
    """A write killed before its end (no clean-up ran) leaves its hidden partial copy, or an
    old one moved aside: the next write of the same output removes them, and nothing else;
    the earlier copy only once the output is in place again (until then it is the one whole
    copy there is)."""
    out = tmp_path / "run[1].ckpt"  # a name with glob characters
    left = [tmp_path / f".run[1].ckpt{PARTIAL}dead", tmp_path / ".run[1].ckpt.old-dead"]
    left[0].mkdir()
    (left[0] / "piece").write_text("half")
    left[1].write_text("old")
    others = [tmp_path / f".other.ckpt{PARTIAL}live", tmp_path / "run1.ckpt", tmp_path / f".run[1].ckptx{PARTIAL}a"]
    for p in others:
        p.write_text("not this output's")
    stage = StagedFile(out)
    assert stage.stale == left[:1] and left[1].read_text() == "old"
    with stage as tmp:
        tmp.write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name] + [p.name for p in others])


@pytest.mark.parametrize("swap", ["exchange", "aside"])
def test_an_old_copy_that_cannot_be_removed_leaves_the_new_one_saved_and_is_named(tmp_path, monkeypatch, swap):
    """Once the new directory is in place the write has succeeded: an old copy whose removal
    fails (a network file system's busy file) is returned, not raised, under a hidden name
    that says what it is, whole, and the next write of the output removes it."""
    import errno

    from lightning_hetermoe import staging

    if swap == "aside":
        monkeypatch.setattr(staging, "_exchange", lambda a, b: False)

    def busy(old):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(old))

    monkeypatch.setattr(staging, "_remove_old", busy)
    out = tmp_path / "last.ckpt"
    out.mkdir()
    (out / "meta.pt").write_text("old meta")
    staged = partial_sibling(out)
    staged.mkdir()
    (staged / "meta.pt").write_text("new meta")
    old, err = replace_directory(staged, out)
    assert (out / "meta.pt").read_text() == "new meta" and err.errno == errno.EBUSY
    assert old.parent == tmp_path and old.name.startswith(".last.ckpt.old-") and staging.is_earlier_copy(old, out)
    assert (old / "meta.pt").read_text() == "old meta"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", old.name])
    monkeypatch.undo()
    assert staging.remove_stale(out) == [old] and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_earlier_copy_moved_aside_stays_while_the_output_is_missing_and_is_named(tmp_path):
    """Where the system cannot swap two names, the old output moves aside before the new one
    moves in: a write killed between the two leaves the output missing and its earlier copy
    whole beside it. That copy is then the only one there is: the next write keeps it until
    its own output is in place, and a message saying the output is missing names it."""
    from lightning_hetermoe import staging

    out = tmp_path / "last.ckpt"
    earlier = tmp_path / ".last.ckpt.old-1a2b"
    earlier.mkdir()
    (earlier / "meta.pt").write_text("step 6")
    partial = tmp_path / f".last.ckpt{PARTIAL}3c4d"
    partial.mkdir()
    note = staging.unfinished_note(out)
    assert note == ("; beside it, .last.ckpt.old-1a2b is its earlier copy, whole, moved aside by a save that did not "
                    "finish: rename it to last.ckpt to use it")
    assert staging.remove_stale(out) == [partial], "the partial copy goes, the whole earlier one stays"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.old-1a2b"]
    out.mkdir()  # the output in place again: the earlier copy is stale now
    assert staging.remove_stale(out) == [earlier] and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # an output whose own name holds the partial mark: its earlier copy is still told by what follows the name
    odd = tmp_path / "run.partial-7.ckpt"
    (tmp_path / ".run.partial-7.ckpt.old-5e6f").mkdir()
    assert staging.remove_stale(odd) == [] and "is its earlier copy, whole" in staging.unfinished_note(odd)
