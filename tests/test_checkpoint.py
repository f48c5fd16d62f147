"""training/checkpoint.py in-process: init_from's load_matching_weights (runs/checkpoint.py: its report, and the
values it copies), resume from an explicit checkpoint path, a run dir or `auto`, the manifest catching a corrupt
file of the right size and a missing manifest, keep_checkpoints pruning (train.py resuming from an explicit
checkpoint path that is not the latest: tests/test_train.py)."""
import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from model import DecoderLM, LMConfig
from runs.checkpoint import load_matching_weights
from training.checkpoint import checkpoint_problem, checkpoints, load_checkpoint, resolve_resume, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64)
    return DecoderLM(LMConfig(**{**config, **overrides}))


def test_load_matching_weights_reports_and_copies(tmp_path):
    """Source: 3 softmax layers. Target: 2 layers, DSA in layer 0 (its indexer is new), a wider FFN
    (shape mismatch): the same-name same-shape tensors are copied exactly, the others keep the
    target's own init, and the report names each group; a run dir loads through its final/."""
    source = tiny(seed=1, num_hidden_layers=3)
    with torch.no_grad():  # every tensor off its init (norms start at ones in both models)
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    source.save_pretrained(tmp_path / "run" / "final")
    target = tiny(seed=2, intermediate_size=96, mixer=["dsa", "softmax"], mixer_options={"dsa": {"topk": 4}})
    before = {k: v.clone() for k, v in target.state_dict().items()}

    report = load_matching_weights(target, tmp_path / "run")

    src, own = source.state_dict(), target.state_dict()
    mismatched = [f"layers.{i}.ffn.{w}_proj.weight" for i in (0, 1) for w in ("down", "gate", "up")]
    assert report["shape_mismatch"] == mismatched
    assert report["unused"] == sorted(k for k in src if k.startswith("layers.2."))
    assert report["new"] == sorted(k for k in own if ".indexer." in k) and report["new"]
    assert report["loaded"] == sorted(k for k in own if k in src and k not in mismatched)
    for k in report["loaded"]:
        assert torch.equal(own[k], src[k]), k
        assert not torch.equal(before[k], src[k]), k  # a real copy
    for k in report["new"] + mismatched:
        assert torch.equal(own[k], before[k]), k


def make_run(run_dir, steps, keep=10, seed=0):
    """A tiny model + AdamW + cosine schedule stepped once per checkpoint; returns (model, optimizer,
    scheduler) and the state saved at each step: {step: (weights, AdamW exp_avg of embed_tokens, lr)}."""
    model = tiny(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, 1, 10, min_lr_rate=0.1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    saved = {}
    for step in steps:
        model(ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        save_checkpoint(run_dir, model, [opt], sched, {"step": step, "tokens_seen": 0, "elapsed": 0.0, "processes": 1},
                        keep)
        saved[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                       opt.state[model.embed_tokens.weight]["exp_avg"].clone(), sched.get_last_lr()[0])
    return model, saved


def test_resume_from_an_explicit_checkpoint_a_run_dir_or_auto(tmp_path):
    """An explicit checkpoint path is used as given (not the run's latest), a run dir gives its latest,
    `auto` the latest of this run_dir; the explicit one loads into a fresh model, optimizer and
    scheduler with the weights, AdamW moments and lr it was saved with."""
    run = tmp_path / "run"
    _, saved = make_run(run, [2, 4, 6])
    step4, step6 = run / "checkpoints" / "step_0000004", run / "checkpoints" / "step_0000006"
    assert resolve_resume(str(step4), tmp_path / "elsewhere") == step4
    assert resolve_resume(str(run), tmp_path / "elsewhere") == step6
    assert resolve_resume("auto", run) == step6
    assert resolve_resume("auto", tmp_path / "fresh") is None and resolve_resume(None, run) is None
    with pytest.raises(FileNotFoundError, match="neither a checkpoint nor a run dir"):
        resolve_resume(str(tmp_path / "nope"), run)

    model = tiny(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, 1, 10, min_lr_rate=0.1)
    state = load_checkpoint(resolve_resume(str(step4), run), model, [opt], sched)
    weights, exp_avg, lr = saved[4]
    assert state["step"] == 4 and sched.get_last_lr()[0] == lr != saved[6][2]
    assert opt.param_groups[0]["lr"] == lr  # the lr the next step uses: the optimizer's own state, not just the scheduler's
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert torch.equal(opt.state[model.embed_tokens.weight]["exp_avg"], exp_avg)


def test_a_corrupt_file_of_the_right_size_is_caught_by_its_checksum(tmp_path):
    run = tmp_path / "run"
    make_run(run, [2, 4])
    step2, step4 = run / "checkpoints" / "step_0000002", run / "checkpoints" / "step_0000004"
    shard = next((step4 / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different content
    shard.write_bytes(bytes(data))
    assert checkpoint_problem(step4) == f"{shard} does not match its checksum (corrupt)"
    warnings = []
    assert resolve_resume("auto", run, warn=warnings.append) == step2
    assert len(warnings) == 1 and str(shard) in warnings[0] and "corrupt" in warnings[0]


def test_a_missing_manifest_makes_a_checkpoint_unusable(tmp_path):
    run = tmp_path / "run"
    make_run(run, [2, 4])
    step2, step4 = run / "checkpoints" / "step_0000002", run / "checkpoints" / "step_0000004"
    (step4 / "manifest.json").unlink()
    assert checkpoint_problem(step4) == f"{step4 / 'manifest.json'} is missing"
    warnings = []
    assert resolve_resume("auto", run, warn=warnings.append) == step2 and "manifest.json is missing" in warnings[0]
    (step2 / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no usable checkpoint"):
        resolve_resume("auto", run, warn=warnings.append)


def test_keep_checkpoints_prunes_to_the_latest(tmp_path):
    make_run(tmp_path / "two", [1, 2, 3, 4, 5], keep=2)
    assert [p.name for p in checkpoints(tmp_path / "two")] == ["step_0000004", "step_0000005"]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_0000004", "step_0000005"]
    make_run(tmp_path / "all", [1, 2, 3], keep=0)  # 0: keep every checkpoint
    assert [p.name for p in checkpoints(tmp_path / "all")] == ["step_0000001", "step_0000002", "step_0000003"]
