"""The command line's run: parse and check the flags, train, and turn every way a run can end
into an exit status, with one line saying why (`pretrain_gpt.py`, the memory probe)."""

import contextlib
import sys

from megatron.common.errors import RunFailed, UserError
from megatron.distributed.data_parallel import ReductionFailed
from megatron.pipeline.p2p import PeerLost, describe_rank
from megatron.training.arguments import parse_args
from megatron.training.faults import (
    another_rank_reported_an_error,
    end_stopped_peers,
    report_error,
)


def run_pretraining(argv, forward_step_func) -> int:
    """Train with the flags `argv` (None: the command line's) and `forward_step_func`; the
    exit status: 0, 2 for a user's mistake, 3 when training diverged, 1 when a peer was lost."""
    with whole_lines():
        return _run(argv, forward_step_func)


def _run(argv, forward_step_func) -> int:
    try:
        args = parse_args(argv)  # validated before megatron-core is even imported
        from megatron.training.training import pretrain

        pretrain(args, forward_step_func)
    except UserError as error:  # every rank's, once per distinct message
        report_error(str(error))
        return 2
    except RunFailed as failure:  # diverged
        report_error(str(failure))
        return failure.exit_code
    except (PeerLost, ReductionFailed) as lost:  # a neighbour or a replica is stuck or gone
        if not lost.timed_out and another_rank_reported_an_error():
            return 1  # it failed first and said why; "lost" here is only the consequence
        stopped = end_stopped_peers() if lost.timed_out else []
        ended = "".join(f"; {describe_rank(rank)} was stopped: ended" for rank in stopped)
        report_error(f"{lost}{ended}")
        return 1
    return 0


@contextlib.contextmanager
def whole_lines():
    """Each line of stdout and stderr in one write while the run lasts. torchrun runs its
    workers unbuffered (`python -u`), where print() writes the text and its newline separately:
    all ranks share one terminal or pipe, so another rank's line could land between them,
    gluing two lines (an `error:` line after a log line's text no longer starts its line)."""
    streams = [s for s in (sys.stdout, sys.stderr) if hasattr(s, "reconfigure")]
    saved = [(s.line_buffering, s.write_through) for s in streams]
    for stream in streams:
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        yield
    finally:
        for stream, (line_buffering, write_through) in zip(streams, saved):
            stream.flush()
            stream.reconfigure(line_buffering=line_buffering, write_through=write_through)
