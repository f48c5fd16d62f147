"""training/objectives/linearize/: the student takes every teacher tensor (GQA key/value heads repeated where the
student has one per query head), a softmax student of a softmax teacher has transfer loss and KL exactly 0
(and a linearized one does not), the transfer stage gives gradients to exactly the parameters it names,
the distillation KL against a hand computation; through train.py: the stages under 2-process DDP equal 1
process with accumulation, a stage boundary survives SIGTERM + resume, and a teacher that does not fit is
one line."""
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, TINY, ddp_launcher, run_train, train_here
from model import DecoderLM, LMConfig
from model.mixers.attention_projections import project_qkv
from runs.checkpoint import load_matching_weights
from training.objectives.linearize.linearization import Linearization
from training.objectives.linearize.losses import distill_kl
from training.objectives.linearize.teacher import (kl_with_each_layer_softmax, load_teacher, parse_keep_softmax,
                                                   teacher_state_for, with_softmax_layers)
from runs.metrics import read_metrics

SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64)
LINEARIZE = OmegaConf.create({"transfer_steps": 2, "transfer_loss": "mse", "transfer_target": "output",
                              "transfer_trains": "new", "keep_softmax": None, "select_steps": 0, "distill_steps": 2,
                              "temperature": 1.0, "ce_weight": 0.0})
CORE = OmegaConf.merge(LINEARIZE, {"transfer_target": "mixer_core"})


def teacher(seed=0, **shape) -> DecoderLM:
    """A softmax model whose every tensor is off its init (the norms start at ones in every model)."""
    torch.manual_seed(seed)
    model = DecoderLM(LMConfig(**{**SHAPE, **shape}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


GDN_V = {"gdn": {"expand_v": 1}}  # gdn's value heads as wide as the teacher's: its v and o projections load


def student_of(source: DecoderLM, mixer, lc=LINEARIZE, mixer_options=GDN_V) -> tuple[Linearization, dict]:
    torch.manual_seed(1)
    student = DecoderLM(LMConfig(**{**SHAPE, "num_hidden_layers": source.config.num_hidden_layers}, mixer=mixer,
                                 mixer_options=mixer_options))
    report = load_matching_weights(student, teacher_state_for(student, source))
    return Linearization(student, source, lc, report["new"]), report


def batch(seed=0, documents=True):
    """Two rows of 24 tokens; with documents, row 0 packs two documents (position_ids restart at 10)."""
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(seed))
    out = {"input_ids": ids, "labels": ids}
    if documents:
        pos = torch.arange(24).repeat(2, 1)
        pos[0, 10:] = torch.arange(14)
        out["position_ids"] = pos
    return out


MIXER_NEW = {  # what each mixer adds to softmax attention's q/k/v/o projections
    "derived_gdn": set(),
    "linear": set(),
    "gdn": {"a_proj.weight", "b_proj.weight", "g_proj.weight", "q_conv.conv.weight", "k_conv.conv.weight",
            "v_conv.conv.weight", "A_log", "dt_bias", "o_norm.weight"},
}


@pytest.mark.parametrize("mixer", ["derived_gdn", "linear", "gdn", ["gdn", "softmax"]])
def test_every_teacher_tensor_lands_in_the_student(mixer):
    """Every teacher tensor is in the student, equal; GDN's k and v projections (one head per query head)
    are the teacher's 2 grouped heads each repeated twice (head h = group h // 2); what the report calls
    new is exactly what the mixer adds."""
    source = teacher()
    lin, report = student_of(source, mixer)
    own, theirs = lin.student.state_dict(), source.state_dict()
    kinds = lin.student.config.layer_mixers
    d = source.config.head_dim
    for name, w in theirs.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is not None and kinds[layer] == "gdn" and name.endswith(("k_proj.weight", "v_proj.weight")):
            assert own[name].shape == (4 * d, 32) and w.shape == (2 * d, 32)
            for h in range(4):
                assert torch.equal(own[name][h * d:(h + 1) * d], w[(h // 2) * d:(h // 2 + 1) * d]), (name, h)
        else:
            assert torch.equal(own[name], w), name
    expected_new = {f"layers.{i}.mixer.{n}" for i, kind in enumerate(kinds) for n in MIXER_NEW.get(kind, ())}
    assert set(report["new"]) == expected_new and report["unused"] == [] and report["shape_mismatch"] == []
    assert sorted(report["loaded"]) == sorted(theirs)


def test_softmax_student_has_zero_transfer_loss_and_kl_and_a_linearized_one_does_not():
    """A softmax student of a softmax teacher, on packed documents: every layer's output on the teacher's own
    mixer input equals the teacher's exactly (transfer loss 0, both losses), the logits too (KL 0); a
    derived_gdn student's are not (the check can fail)."""
    source = teacher()
    for loss in ("mse", "relative"):  # (no transfer steps: a softmax student has nothing to transfer in a run)
        lin, _ = student_of(source, "softmax", OmegaConf.merge(LINEARIZE, {"transfer_loss": loss, "transfer_steps": 0}))
        lin.set_stage("transfer")
        out = lin(**batch())
        assert out.loss.item() == 0.0 and out.aux_metrics["linearize/transfer/loss"].item() == 0.0
        assert all(out.aux_metrics[f"linearize/transfer/layer{i}/rel_error"].item() == 0.0 for i in range(2))
    lin.set_stage("distill")
    out = lin(**batch())
    assert out.aux_metrics["linearize/distill/kl"].item() == 0.0 and out.loss.item() == 0.0

    # each layer is fit on the teacher's hidden states, not the student's own: a student whose layer-0 FFN differs
    # still matches the teacher's attention exactly in every layer, while its logits do not
    with torch.no_grad():
        lin.student.layers[0].ffn.down_proj.weight.mul_(2)
    lin.set_stage("transfer")
    assert lin(**batch()).loss.item() == 0.0
    lin.set_stage("distill")
    assert lin(**batch()).aux_metrics["linearize/distill/kl"].item() > 1e-6

    linearized, _ = student_of(source, "derived_gdn")
    linearized.set_stage("transfer")
    out = linearized(**batch())
    errors = [out.aux_metrics[f"linearize/transfer/layer{i}/rel_error"].item() for i in range(2)]
    assert out.loss.item() > 0 and all(0.01 < e < 2 for e in errors), errors
    linearized.set_stage("distill")
    assert linearized(**batch()).aux_metrics["linearize/distill/kl"].item() > 1e-4


@pytest.mark.parametrize("mixer,trains", [("gdn", "new"), ("gdn", "mixer"), ("derived_gdn", "new"),
                                          (["derived_gdn", "softmax"], "new")])
def test_transfer_gives_gradients_to_exactly_the_named_parameters(mixer, trains):
    """transfer: only the named parameters get gradients (the others' grads stay None), and the named ones
    are what the option says: gdn's own additions (new) or its whole mixer (mixer); a mixer that adds nothing
    trains its q/k/v/o; a kept softmax layer nothing. distill: every parameter."""
    lc = OmegaConf.merge(LINEARIZE, {"transfer_trains": trains})
    lin, report = student_of(teacher(), mixer, lc)
    kinds = lin.student.config.layer_mixers
    linearized = [i for i, kind in enumerate(kinds) if kind != "softmax"]
    mixer_params = {n for n, _ in lin.student.named_parameters() if any(n.startswith(f"layers.{i}.mixer.") for i in linearized)}
    expected = (mixer_params & set(report["new"])) if trains == "new" and report["new"] else mixer_params
    assert lin.transfer_parameters == sorted(expected) and expected
    lin.set_stage("transfer")
    lin(**batch()).loss.backward()
    got = {n for n, p in lin.student.named_parameters() if p.grad is not None}
    assert got == expected
    assert all(lin.student.get_parameter(n).grad.abs().sum() > 0 for n in expected)
    assert all(p.grad is None for p in lin.teacher.parameters())

    lin.student.zero_grad(set_to_none=True)
    lin.set_stage("distill")
    lin(**batch()).loss.backward()
    assert all(p.grad is not None for p in lin.student.parameters())


ATTENTION = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


@pytest.mark.parametrize("trains", ["new", "mixer"])
def test_mixer_core_freezes_qkvo_and_trains_only_the_students_own(trains):
    """transfer_target=mixer_core: transfer_trains=new trains exactly gdn's additions (q, k, v and o keep no
    gradient and do not require one), mixer all but o_proj; one SGD step changes exactly those."""
    lin, _ = student_of(teacher(), "gdn", OmegaConf.merge(CORE, {"transfer_trains": trains}))
    mixer_params = {n for n, _ in lin.student.named_parameters() if ".mixer." in n}
    frozen = {f"layers.{i}.mixer.{name}" for i in range(2) for name in (ATTENTION if trains == "new" else ATTENTION[3:])}
    expected = ({f"layers.{i}.mixer.{name}" for i in range(2) for name in MIXER_NEW["gdn"]} if trains == "new"
                else mixer_params - frozen)
    assert set(lin.transfer_parameters) == expected and frozen <= mixer_params
    lin.set_stage("transfer")
    params = dict(lin.student.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    lin(**batch()).loss.backward()
    assert all(params[n].grad is None and not params[n].requires_grad for n in frozen)
    assert {n for n, p in params.items() if p.grad is not None} == expected
    torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.1).step()
    assert {n for n, p in params.items() if not torch.equal(p, before[n])} == expected


def test_mixer_core_fits_the_input_of_o_proj():
    """The mixer_core loss is sum over layers of mean (c_s - c_t)^2, c = the attention core [B, T, H d] computed by
    hand from each mixer's projections (o_proj(c) is each mixer's output); the output loss is that of o_proj(c)."""
    source = teacher()
    lin, _ = student_of(source, "derived_gdn", CORE)
    out_lin, _ = student_of(source, "derived_gdn")
    lin.set_stage("transfer"), out_lin.set_stage("transfer")
    data = batch()
    from training.objectives.linearize.losses import mixer_io

    with torch.no_grad(), mixer_io(source) as io:
        source(data["input_ids"], position_ids=data["position_ids"])
    core_loss, output_loss = 0.0, 0.0
    for i in range(2):
        x, segments, y_teacher = io[i]
        cores = []
        for mixer in (lin.student.layers[i].mixer, source.layers[i].mixer):
            q, k, v = project_qkv(mixer, x, 0, segments.position_ids)
            cores.append(mixer.core(q, k, v, None, None, segments).reshape(*x.shape[:2], -1))
        c_s, c_t = cores
        torch.testing.assert_close(source.layers[i].mixer.o_proj(c_t), y_teacher, rtol=1e-6, atol=1e-7)
        core_loss += (c_s - c_t).pow(2).mean().item()
        output_loss += (lin.student.layers[i].mixer.o_proj(c_s) - y_teacher).pow(2).mean().item()
    with torch.no_grad():
        assert lin(**data).loss.item() == pytest.approx(core_loss, rel=1e-5)
        assert out_lin(**data).loss.item() == pytest.approx(output_loss, rel=1e-5)
    assert abs(core_loss - output_loss) > 0.1 * core_loss


def test_mixer_core_with_nothing_to_train_skips_the_transfer_stage():
    """derived_gdn adds no parameters: under mixer_core nothing trains, the stage is skipped (distill starts at
    step 1, the finetune stage gets the transfer's steps) and the plan says so in one line."""
    from training.objectives.linearize import stage_at, stage_ends

    lin, _ = student_of(teacher(), "derived_gdn", CORE)
    assert lin.transfer_parameters == [] and lin.plan.transfer_steps == 0
    assert [stage_at(s, lin.plan) for s in range(5)] == ["distill", "distill", "finetune", "finetune", "finetune"]
    assert stage_ends(lin.plan, 6) == {2: "distill"}
    assert lin.describe(6) == ("linearize: no transfer: with transfer_target=mixer_core the mixers of layers [0, 1] "
                               "have nothing to train (they add no parameters, and q/k/v/o stay the teacher's), so its "
                               "2 steps go to the stages after it; distill steps 1-2 (T=1, ce_weight=0); finetune steps 3-6")


def test_mixer_core_with_an_output_projection_of_its_own_is_one_line():
    """gdn's default value heads (expand_v 2) make an o_proj that does not load: its core has no teacher target."""
    with pytest.raises(ValueError) as e:
        student_of(teacher(), "gdn", CORE, mixer_options={})
    assert str(e.value) == ("linearize.transfer_target=mixer_core, but layer 0's GatedDeltaNet output projection "
                            "layers.0.mixer.o_proj is not the teacher's o_proj (new, or of another shape); valid: output, "
                            "or a student whose output projection loads the teacher's (gdn: mixer.options.expand_v=1)")


def test_keep_softmax_parses_and_a_bad_value_is_one_line():
    kinds = ["derived_gdn", "derived_gdn", "softmax", "derived_gdn"]
    assert parse_keep_softmax(None, kinds) is None
    assert parse_keep_softmax("auto:3", kinds) == 3
    assert parse_keep_softmax([3, 0, 3], kinds) == [0, 3]
    valid = ("valid: null, a list of layer indices in 0..3, or auto:<m> with 1 <= m <= 3 (the student's non-softmax "
             "layers)")
    for bad, shown in [("auto:x", "auto:x"), ("auto:0", "auto:0"), ("auto:4", "auto:4"), ("auto", "auto"),
                       ([4], "[4]"), ([-1], "[-1]"), (True, "True")]:
        with pytest.raises(ValueError) as e:
            parse_keep_softmax(bad, kinds)
        assert str(e.value) == f"linearize.keep_softmax={shown}; {valid}"


def test_the_layer_whose_restoring_lowers_the_kl_most_wins():
    """A 4-layer derived_gdn student whose layer-2 output projection is made bad (x 8): restoring layer 2 to the
    teacher's attention gains the most KL. Each KL equals that of a student built with that layer softmax (the
    teacher's weights), computed by distill_kl."""
    source = teacher(num_hidden_layers=4)
    lin, _ = student_of(source, "derived_gdn", CORE)
    with torch.no_grad():
        lin.student.layers[2].mixer.o_proj.weight.mul_(8)
    batches = [batch(0), batch(1)]
    linear_kl, kls = kl_with_each_layer_softmax(lin.student, source, batches, [0, 1, 2, 3])
    gains = {i: linear_kl - kl for i, kl in kls.items()}
    assert max(gains, key=gains.get) == 2 and gains[2] > 2 * max(gains[i] for i in (0, 1, 3)), gains

    def kl_of(model):
        with torch.no_grad():
            kl = [distill_kl(model(b["input_ids"], position_ids=b["position_ids"]).logits,
                             source(b["input_ids"], position_ids=b["position_ids"]).logits,
                             torch.nn.functional.pad(b["labels"][:, 1:], (0, 1), value=-100), 1.0) for b in batches]
        return sum(kl).item() / 2  # the batches hold as many targets each

    assert linear_kl == pytest.approx(kl_of(lin.student), rel=1e-5)
    for i in range(4):
        hybrid = DecoderLM(LMConfig(**{**SHAPE, "num_hidden_layers": 4}, mixer="derived_gdn"))
        hybrid.load_state_dict(lin.student.state_dict())
        with_softmax_layers(hybrid, [i])
        hybrid.layers[i].mixer.load_state_dict(source.layers[i].mixer.state_dict())
        assert hybrid.config.layer_mixers[i] == "softmax" and isinstance(hybrid.layers[i].mixer, type(source.layers[i].mixer))
        assert kls[i] == pytest.approx(kl_of(hybrid.eval()), rel=1e-5), i


def test_distill_kl_against_a_hand_computation():
    """T^2 mean over the tokens with a target of sum_v p_t(v) log(p_t(v) / p_s(v)), p = softmax(z / T), written out
    in float64 loops; the position without a target (-100) is left out."""
    g = torch.Generator().manual_seed(0)
    student, teacher_logits = torch.randn(2, 3, 5, generator=g), 3 * torch.randn(2, 3, 5, generator=g)
    targets = torch.tensor([[1, 2, -100], [0, 4, 3]])
    for temperature in (1.0, 2.5):
        total, count = 0.0, 0
        for b in range(2):
            for t in range(3):
                if targets[b, t] == -100:
                    continue
                zs = [float(x) / temperature for x in student[b, t]]
                zt = [float(x) / temperature for x in teacher_logits[b, t]]
                ps = [math.exp(z) / sum(math.exp(y) for y in zs) for z in zs]
                pt = [math.exp(z) / sum(math.exp(y) for y in zt) for z in zt]
                total += sum(p * math.log(p / q) for p, q in zip(pt, ps))
                count += 1
        expected = temperature ** 2 * total / count
        assert distill_kl(student, teacher_logits, targets, temperature).item() == pytest.approx(expected, rel=1e-6)


# through train.py ---------------------------------------------------------------------------------
STAGES = ["objective=linearize", "mixer=derived_gdn", "linearize.transfer_target=output", "linearize.transfer_steps=2", "linearize.distill_steps=2", "trainer.max_steps=6",
          "trainer.eval_every=100"]


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def stages(run_dir):
    return {r["step"]: int(r["linearize/stage"]) for r in read_metrics(run_dir) if "linearize/stage" in r}


@pytest.mark.slow
def test_stages_under_ddp_equal_one_process_with_accumulation(tmp_path, tiny_run, data_cache):
    """transfer, distill and finetune on 2 processes (DDP; the trained set changes at each stage) give the
    losses, transfer errors and KL of 1 process with accumulation, step by step; each stage's last step is
    evaluated, and step 0 (the zero-shot student)."""
    from test_distributed import run_info

    teacher_dir, _ = tiny_run
    one, two = tmp_path / "one", tmp_path / "two"
    train_here(one, *STAGES, f"init_from={teacher_dir}", "trainer.grad_accum=2", "trainer.ckpt_every=2", cache=data_cache)
    run_train(two, *STAGES, f"init_from={teacher_dir}", launcher=ddp_launcher(), cache=data_cache)
    assert run_info(one)["processes"] == 1 and run_info(two)["processes"] == 2
    assert run_info(two)["ddp_find_unused_parameters"] is True
    assert stages(one) == stages(two) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}
    rows = [{r["step"]: r for r in read_metrics(d)} for d in (one, two)]
    for step in range(1, 7):
        for key in ("train/loss", "linearize/transfer/loss", "linearize/transfer/layer1/rel_error", "linearize/distill/kl"):
            if key in rows[0][step]:
                assert rows[1][step][key] == pytest.approx(rows[0][step][key], rel=1e-4, abs=1e-7), (step, key)
    evaluated = sorted(r["step"] for r in read_metrics(two) if "val/loss" in r)
    assert evaluated == [0, 2, 4, 6]

    # the checkpoint at the transfer -> distill boundary (its optimizer state holds only what transfer trained)
    # resumes on 2 processes and continues the 1-process curve
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_0000002", resumed / "checkpoints" / "step_0000002")
    proc = run_train(resumed, *STAGES, f"init_from={teacher_dir}", "resume=auto", launcher=ddp_launcher(), cache=data_cache)
    assert "resumed from" in proc.stdout and "at step 2 (saved by 1 process(es), now 2)" in proc.stdout
    assert losses(resumed) == pytest.approx({s: losses(one)[s] for s in range(3, 7)}, rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_a_stage_boundary_survives_sigterm_and_resume(tmp_path, tiny_run, data_cache):
    """SIGTERM during the transfer stage saves a checkpoint; the printed command resumes it through the
    transfer -> distill -> finetune boundaries with the losses of an uninterrupted run and into the same
    (offline) W&B run. The teacher is loaded again, never saved."""
    teacher_dir, _ = tiny_run
    run, reference = tmp_path / "sig", tmp_path / "reference"
    constant = ["trainer.schedule=constant", "trainer.warmup_steps=0", "mixer=derived_gdn", f"init_from={teacher_dir}",
                "objective=linearize", "linearize.transfer_target=output", "linearize.transfer_steps=8",
                "linearize.distill_steps=4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWAPLM_CACHE": str(data_cache), "WANDB_MODE": "offline"}
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "logger=wandb", *constant, f"run_dir={run}",
           "trainer.max_steps=100000", "trainer.ckpt_every=100000", "trainer.eval_every=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not losses(run) and time.time() < deadline:  # the first step has run
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:]
    printed = re.search(r"continue with `([^`]*)`", out).group(1)
    (ckpt,) = (run / "checkpoints").glob("step_*")
    step = int(ckpt.name.split("_")[1])
    assert 1 <= step < 8, step  # stopped inside transfer: the resumed run crosses both boundaries
    assert not any("teacher" in p.name for p in ckpt.rglob("*"))
    proc = subprocess.run([sys.executable, *shlex.split(printed)[1:], "trainer.max_steps=14"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resumed from {ckpt} at step {step}" in proc.stdout
    train_here(reference, *constant, "trainer.max_steps=14", "trainer.sample_tokens=0", cache=data_cache)
    a, b = losses(reference), losses(run)
    assert stages(run) == stages(reference) == {s: 0 if s <= 8 else 1 if s <= 12 else 2 for s in range(1, 15)}
    for s in range(step + 1, 15):
        assert b[s] == pytest.approx(a[s], abs=1e-6), (s, a, b)
    run_id = (run / "wandb_run_id").read_text().strip()
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all((f / f"run-{run_id}.wandb").exists() for f in folders), folders


@pytest.mark.slow
def test_keep_softmax_auto_through_train_py(tmp_path, tiny_run, data_cache):
    """keep_softmax=auto:1 after 2 select steps (output target, so derived_gdn's q/k/v/o train in them): the layer
    with the larger logged KL gain is the one the run keeps softmax, in its printed line, its step-0 metrics, its
    config.yaml (a list: a resume keeps it) and its exported model; the scores are of the student before it."""
    teacher_dir, _ = tiny_run
    run = tmp_path / "auto"
    printed = train_here(run, "objective=linearize", "mixer=derived_gdn", f"init_from={teacher_dir}",
                         "linearize.transfer_target=output", "linearize.keep_softmax=auto:1", "linearize.select_steps=2",
                         "linearize.transfer_steps=2", "linearize.distill_steps=2", "trainer.max_steps=6",
                         "trainer.sample_tokens=0", cache=data_cache)
    start = next(r for r in read_metrics(run) if r["step"] == 0 and "val/loss" in r)
    gains = [start[f"linearize/select/layer{i}/kl_gain"] for i in range(2)]
    chosen = max(range(2), key=lambda i: gains[i])
    assert [start[f"linearize/select/layer{i}/kept"] for i in range(2)] == [float(i == chosen) for i in range(2)]
    assert start["linearize/select/kl"] > max(gains) > 0
    assert "after 2 transfer steps" in printed and f"kept softmax: layers [{chosen}]" in printed
    assert OmegaConf.load(run / "config.yaml").linearize.keep_softmax == [chosen]
    expected = ["derived_gdn", "derived_gdn"]
    expected[chosen] = "softmax"
    assert LMConfig.from_pretrained(run / "final").layer_mixers == expected
    assert f"transfer steps 1-2 on layers [{1 - chosen}]" in printed


@pytest.mark.slow
def test_a_teacher_that_is_not_softmax_is_one_line(tmp_path, tiny_run, data_cache):
    """A run with a gdn model as the teacher stops before writing anything, with one line naming it."""
    teacher_dir = tmp_path / "gdn_teacher"
    DecoderLM(LMConfig.from_pretrained(tiny_run[0] / "final", mixer="gdn")).save_pretrained(teacher_dir)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        train_here(run, "objective=linearize", "mixer=derived_gdn", f"init_from={teacher_dir}", "linearize.transfer_steps=2",
                   cache=data_cache)
    assert str(e.value) == (
        f"init_from={teacher_dir}: the teacher's layers are ['gdn', 'gdn']; valid: a softmax model (every layer "
        "softmax), whose attention the student linearizes")
    assert not run.exists()


def test_a_teacher_of_another_shape_or_nothing_to_transfer_is_one_line(tmp_path):
    """A student narrower than the teacher; a transfer stage with every student layer softmax: one line each."""
    teacher().save_pretrained(tmp_path / "teacher")
    narrow = LMConfig(**{**SHAPE, "hidden_size": 16})
    with pytest.raises(ValueError) as e:
        load_teacher(str(tmp_path / "teacher"), narrow)
    assert str(e.value) == (f"init_from={tmp_path / 'teacher'}: the teacher has hidden_size=32 (student 16), head_dim=8 "
                            "(student 4); valid: a student of the teacher's shape (its model.* keys, data.vocab_size and "
                            "the tokenizer it was trained with)")
    with pytest.raises(ValueError) as e:
        student_of(teacher(), "softmax")
    assert str(e.value).startswith("linearize.transfer_steps=2, but every student layer is softmax, as the teacher's; "
                                   "valid: 0, or a student with other mixers") and "\n" not in str(e.value)


def test_vala_with_document_segments_equals_vala_on_each_document():
    """studies/linearize_error.py's VaLA core under a packed batch's segment mask: each document's outputs are those
    of VaLA run on that document alone (its means and t restart at the document's first token)."""
    from model.segments import DocumentSegments
    from studies.linearize_error import vala_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    packed = vala_attention(q, k, v, 0.3, DocumentSegments(pos).attention_mask[:, 0])
    for part in (slice(0, 10), slice(10, 24)):
        alone = vala_attention(q[:, part], k[:, part], v[:, part], 0.3)
        torch.testing.assert_close(packed[:, part], alone, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(vala_attention(q, k, v, 0.3)[:, 10:], packed[:, 10:])
