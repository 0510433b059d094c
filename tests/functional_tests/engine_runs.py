"""Cases trained by the single-process engine in this process; their results printed as one
JSON line.

    python tests/functional_tests/engine_runs.py SPEC.json

SPEC maps a name to {"flags": pretrain_gpt.py's flags, "stop_at": N or null}. With `stop_at`,
the run writes its checkpoint at every drain point, is stopped at its evaluation of iteration
N (by an exception, as a study is by a kill), and is trained again from the checkpoint: the
result is the resumed run's, with "first_evaluation", the first iteration it evaluated, or
{"refused": the error} where the engine refuses to checkpoint the run. With "exit_interval": N
instead, the run is stopped by --exit-interval N (its only checkpoint the one written there)
and trained again without the flag; the result adds "stopped_at" and "stopped_final" (the
first part's final evaluation, null when it made none).
"""

import json
import os
import sys
import tempfile

from megatron.common.errors import UserError
from megatron.studies.single_process_engine import parse_engine_args, train


class Stopped(Exception):
    pass


def stopped_and_resumed(flags: list[str], stop_at: int, directory: str) -> dict:
    checkpoint = os.path.join(directory, "checkpoint.pt")

    def stop(message: str) -> None:
        if message.startswith(f"iteration {stop_at}:"):
            raise Stopped

    try:
        train(parse_engine_args(flags), log=stop, checkpoint=checkpoint, checkpoint_interval_s=0)
    except Stopped:
        pass
    except UserError as error:
        return {"refused": str(error)}
    else:
        raise AssertionError(f"the run never evaluated iteration {stop_at}")
    assert os.path.exists(checkpoint), "no checkpoint was written before the stop"
    evaluated = []
    result = train(parse_engine_args(flags), log=evaluated.append, checkpoint=checkpoint,
                   checkpoint_interval_s=0)  # fmt: skip
    first = int(evaluated[0].split()[1].rstrip(":"))
    return {**result.to_dict(), "first_evaluation": first}


def exited_and_resumed(flags: list[str], interval: int, directory: str) -> dict:
    checkpoint = os.path.join(directory, "checkpoint.pt")
    first = train(parse_engine_args(flags + ["--exit-interval", str(interval)]),
                  checkpoint=checkpoint, checkpoint_interval_s=1e9)  # fmt: skip
    evaluated = []
    result = train(parse_engine_args(flags), log=evaluated.append, checkpoint=checkpoint)
    return {**result.to_dict(), "first_evaluation": int(evaluated[0].split()[1].rstrip(":")),
            "stopped_at": first.stopped_at, "stopped_final": first.final_validation}  # fmt: skip


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    results = {}
    for name, run in spec.items():
        if run.get("exit_interval") is not None:
            with tempfile.TemporaryDirectory() as directory:
                results[name] = exited_and_resumed(run["flags"], run["exit_interval"], directory)
        elif run.get("stop_at") is None:
            results[name] = train(parse_engine_args(run["flags"])).to_dict()
        else:
            with tempfile.TemporaryDirectory() as directory:
                results[name] = stopped_and_resumed(run["flags"], run["stop_at"], directory)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
