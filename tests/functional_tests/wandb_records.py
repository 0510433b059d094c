"""Read back what a W&B run wrote offline: its `run-<id>.wandb` file (under
`<save dir>/wandb/offline-run-*/`).

The file is W&B's record log: a 7-byte header (`:W&B`, a 2-byte magic, a version byte), then
32 KiB blocks of records, each a 7-byte header (checksum, little-endian 2-byte length, type:
1 full, 2 first, 3 middle, 4 last piece) and its bytes; a block's tail shorter than a header
is padding. Each assembled record is a `wandb_internal_pb2.Record` protobuf (from the wandb
package). The reader is ours: the wandb package no longer ships one in Python.
"""

import glob
import json
import os

BLOCK, HEADER = 32768, 7


def records(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    found, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            found.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            found.append(pending + chunk)
    return found


def run_file(save_dir: str) -> str:
    """The one offline run's file under a --wandb-save-dir."""
    paths = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(paths) == 1, paths
    return paths[0]


def read_run(path: str) -> dict:
    """{'project', 'name', 'config' (flag -> value), 'history' (tag -> {step: value})}."""
    from wandb.proto import wandb_internal_pb2

    run = {"project": None, "name": None, "config": {}, "history": {}}
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            step = items.pop("_step", record.history.step.num)
            for tag, value in items.items():
                if not tag.startswith("_"):
                    run["history"].setdefault(tag, {})[step] = value
    return run
