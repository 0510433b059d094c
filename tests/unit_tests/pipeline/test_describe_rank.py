"""Error messages name a rank by its pipeline stage, a rank of another pipeline (a replica's)
too, once every rank's stage is registered at set-up."""

from megatron.pipeline import p2p


def test_a_rank_of_another_pipeline_is_named_by_its_stage(one_rank_group):
    p2p.register_stages({})
    try:
        assert p2p.describe_rank(0) == "stage 0 (rank 0)"  # in this rank's pipeline
        assert p2p.describe_rank(1) == "stage ? (rank 1)"  # not registered
        p2p.register_stages({0: 0, 1: 0, 2: 1, 3: 1})  # PP 2 x DP 2
        assert p2p.describe_rank(1) == "stage 0 (rank 1)"
        assert p2p.describe_rank(3) == "stage 1 (rank 3)"
    finally:
        p2p.register_stages({})
