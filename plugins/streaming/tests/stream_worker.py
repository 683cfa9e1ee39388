"""Streaming runs for test_streaming.py, in every rank of a torchrun job.

``torchrun --nproc_per_node 2 plugins/streaming/tests/stream_worker.py OUT`` trains on a 64-sample stream with 2
dataloader workers per process, saving at step 5, then resumes from checkpoint-5 in a fresh Loop;
for a stream with state_dict/load_state_dict and for one without, each with the default
``train.stream_split`` ("auto": read globally) and with ``"shards"`` (2 x 2 = 4 shards). Each rank
writes ``OUT/result.rank<R>.json``: ``{split: {kind: ...}}``, the stream indices its model saw, per
step, and its weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # streams.py
os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"

import corelooper_streaming  # noqa: E402
from streams import Recorder, StatefulStream, Stream  # noqa: E402

from corelooper.config import TrainArgs  # noqa: E402
from corelooper.loop import Loop as _Loop  # noqa: E402


def Loop(*args, **kwargs):  # noqa: N802 - the Loop, with this plugin (autoload is off here)
    return _Loop(*args, plugins=[corelooper_streaming], **kwargs)


def args(out: Path, **kw) -> TrainArgs:
    return TrainArgs(
        output_dir=str(out),
        max_steps=16,
        save_steps=5,
        per_device_train_batch_size=2,
        dataloader_num_workers=2,
        logging_steps=4,
        disable_tqdm=True,
        learning_rate=1e-2,
        **kw,
    )


def run(out: Path, make, **kw) -> dict:
    model = Recorder()
    Loop(model, args(out, overwrite_output_dir=True, **kw), train_dataset=make()).train()
    resumed = Recorder()
    Loop(resumed, args(out, **kw), train_dataset=make()).train(
        resume_from_checkpoint=str(out / "checkpoint-5")
    )
    return {
        "first": model.seen,
        "resumed": resumed.seen,
        "params_first": [p.tolist() for p in model.parameters()],
        "params_resumed": [p.tolist() for p in resumed.parameters()],
    }


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", 0))
    result = {}
    for split, kw in (("auto", {}), ("shards", {"stream_split": "shards"})):
        result[split] = {
            "stateful": run(out / split / "stateful", lambda: StatefulStream(64), **kw),
            "stateless": run(out / split / "stateless", lambda: Stream(64), **kw),
        }
    (out / f"result.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
