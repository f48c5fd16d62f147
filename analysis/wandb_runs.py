"""W&B runs as analysis.runs.Run: offline run folders (their run-*.wandb transaction logs, read here without the
W&B service) and the finished runs of a project through the W&B API; and the tag the report sets on API runs."""
import json
import re
import struct
from pathlib import Path

from analysis.runs import Run

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-format log of wandb Record protobufs
EXPERT_LOAD = re.compile(r"^(moe/layer\d+)/expert(\d+)/load$")


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, buf = 7, b""  # 7-byte file header, then records: crc32 (4) length (2) type (1) payload
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def unflatten(items) -> dict:
    out = {}
    for item in items:
        keys = list(item.nested_key) or [item.key]
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = json.loads(item.value_json)
    return out


def history_row(values: dict) -> dict:
    """A W&B history row -> a metrics row: 'step' from _step, wall-clock from _runtime, per-expert
    scalars back into moe/layer<i>/load vectors, media dropped."""
    row = {k: v for k, v in values.items() if not k.startswith("_") and not isinstance(v, (dict, list))}
    loads = {}
    for k in [k for k in row if EXPERT_LOAD.match(k)]:
        m = EXPERT_LOAD.match(k)
        loads.setdefault(m.group(1), {})[int(m.group(2))] = row.pop(k)
    for layer, by_expert in loads.items():
        row[f"{layer}/load"] = [by_expert.get(e, 0.0) for e in range(max(by_expert) + 1)]
    row["step"] = values.get("_step", 0)
    if "_runtime" in values and "time/elapsed" not in row:
        row["time/elapsed"] = values["_runtime"]
    return row


def read_wandb_offline(folders: list[Path]) -> Run:
    """One W&B run from its offline folders (training, each resume, each eval.py), oldest first: later
    folders add history rows (a step logged twice keeps its later value), config and summary."""
    config, rows, summary, exit_code, name, group = {}, {}, {}, None, folders[0].name, ""
    for folder in folders:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update(unflatten(record.run.config.update))
                name, group = record.run.display_name or record.run.run_id, record.run.run_group or group
            elif kind == "config":
                config.update(unflatten(record.config.update))
            elif kind == "history":
                flat = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                rows[record.history.step.num] = history_row({**flat, "_step": record.history.step.num})
            elif kind == "summary":
                summary.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update})
            elif kind == "exit" and config.get("trainer"):  # an eval.py folder's exit is not the training's
                exit_code = record.exit.exit_code
    config.pop("_wandb", None)
    run = Run(name, str(folders[-1]), config, [rows[k] for k in sorted(rows)], config.pop("params", None),
              summary={k: v for k, v in summary.items() if k.startswith("eval/")}, group=group)
    if exit_code != 0:
        run.complete, run.note = False, "W&B run did not finish" if exit_code is None else f"W&B exit code {exit_code}"
    return run


def read_wandb_api(path: str) -> list[Run]:
    import wandb

    parts = path.strip("/").split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"--wandb {path!r}: expected ENTITY/PROJECT or ENTITY/PROJECT/GROUP")
    filters = {"group": parts[2]} if len(parts) == 3 else {}
    runs = []
    for r in wandb.Api().runs("/".join(parts[:2]), filters=filters):
        config = {k: v for k, v in r.config.items() if not k.startswith("_")}
        run = Run(r.name, r.url, config, [history_row(h) for h in r.scan_history()], config.pop("params", None),
                  summary={k: v for k, v in r.summary.items() if k.startswith("eval/")}, group=r.group or "", handle=r)
        if r.state != "finished":
            run.complete, run.note = False, f"W&B state {r.state}"
        runs.append(run)
    return runs


def set_tag(wanted: list[tuple[Run, bool]], tag: str) -> list[str]:
    """`tag` on each API run (read_wandb_api's) whose flag is True, off the others; a note for each run whose tags
    could not be changed (no write access, no network: the report stands without the tag)."""
    notes = []
    for run, want in wanted:
        if run.handle is None:
            continue
        try:
            if (tag in run.handle.tags) != want:
                run.handle.tags = [t for t in run.handle.tags if t != tag] + [tag] * want
                run.handle.update()
        except Exception as e:
            notes.append(f"W&B tag {tag} not {'added to' if want else 'removed from'} {run.name}: {e}")
    return notes
