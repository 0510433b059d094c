"""The launch environment's checks: each mistake is one UserError naming the variable."""

import pytest

from megatron.common.errors import UserError
from megatron.training.launch import launch_environment

GOOD = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_a_complete_environment_is_read():
    assert launch_environment(GOOD) == (1, 4, "127.0.0.1", 29500)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"MASTER_ADDR": ""}, "MASTER_ADDR not set: launch with torchrun"),
        ({"RANK": "", "WORLD_SIZE": ""}, "RANK, WORLD_SIZE not set"),
        ({"RANK": "one"}, "RANK='one' is not an integer"),
        ({"RANK": "4"}, "RANK=4 is outside the world: WORLD_SIZE=4 has ranks 0 to 3"),
        ({"RANK": "-1"}, "RANK=-1 is outside the world"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0: the number of processes"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: a TCP port is between 1 and 65535"),
        ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid cannot be "),
    ],
)
def test_each_mistake_is_named(change, expected):
    with pytest.raises(UserError) as raised:
        launch_environment({**GOOD, **change})
    assert str(raised.value).startswith(expected), str(raised.value)
    assert "\n" not in str(raised.value)
