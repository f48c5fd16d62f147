"""common/files.py: temp name then rename, for files and folders, replacing or keeping what is there;
and metrics.jsonl, appended row by row, read while it is written."""
import os

import pytest

from common.files import temp_path, written_then_renamed


def test_a_file_replaces_the_old_one_and_no_temp_is_left(tmp_path):
    final = tmp_path / "eval.json"
    final.write_text("old")
    with written_then_renamed(final) as tmp:
        assert tmp == tmp_path / f"eval.json.tmp{os.getpid()}"
        tmp.write_text("new")
        assert final.read_text() == "old"  # readers see the old file until the rename
    assert final.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


def test_a_folder_replaces_the_old_one(tmp_path):
    final = tmp_path / "final"
    (final / "sub").mkdir(parents=True)
    (final / "sub" / "old.bin").write_bytes(b"x")
    with written_then_renamed(final, tmp=tmp_path / ".tmp_final") as tmp:
        tmp.mkdir()
        (tmp / "new.bin").write_bytes(b"y")
    assert [p.name for p in final.iterdir()] == ["new.bin"] and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_keep_existing_keeps_the_first_writer_and_drops_the_temp(tmp_path):
    """The tokenizer cache: another process saved the same folder first, before or during our write."""
    final = tmp_path / "tok"
    with written_then_renamed(final, keep_existing=True) as tmp:
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("ours")
        final.mkdir()  # the other process renames its folder into place meanwhile
        (final / "tokenizer.json").write_text("theirs")
    assert (final / "tokenizer.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_an_error_removes_the_temp_and_leaves_the_final_alone(tmp_path):
    final = tmp_path / "cache.json"
    final.write_text("good")
    stale = temp_path(final)
    stale.write_text("a killed run's leftover")
    with pytest.raises(RuntimeError), written_then_renamed(final) as tmp:
        assert not tmp.exists()  # the stale temp is cleared first
        tmp.write_text("half")
        raise RuntimeError("write failed")
    assert final.read_text() == "good" and sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_a_half_written_metrics_row_is_not_read_and_a_resumed_writer_drops_it(tmp_path):
    """A reader polling a live run's metrics.jsonl can catch an append half-way (CI once failed on
    exactly that: JSONDecodeError at the cut); a run killed mid-append leaves such a row behind."""
    from types import SimpleNamespace

    from runs.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 5.0}\n{"step": 2, "train/lo')
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": 5.0}]
    writer = MetricsWriter(SimpleNamespace(is_main_process=True), tmp_path, use_tracker=False, step=1)
    writer.log({"train/loss": 4.0}, step=2)
    assert path.read_text() == '{"step": 1, "train/loss": 5.0}\n{"step": 2, "train/loss": 4.0}\n'
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_resumed_writer_keeps_the_rows_up_to_its_step(tmp_path):
    """A run killed past its last checkpoint (SIGKILL) logged steps that its resumed run logs again: the
    resumed writer keeps the rows up to the checkpoint's step; a run starting at step 0 logs afresh."""
    from types import SimpleNamespace

    from runs.metrics import MetricsWriter, read_metrics

    rows = "".join(f'{{"step": {s}, "train/loss": {s}.0}}\n' for s in (0, 1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(rows)
    MetricsWriter(SimpleNamespace(is_main_process=True), tmp_path, use_tracker=False, step=2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    MetricsWriter(SimpleNamespace(is_main_process=True), tmp_path, use_tracker=False, step=0)
    assert read_metrics(tmp_path) == [] and not list(tmp_path.glob("*.tmp*"))
