"""The committed stubs must match what `make proto` generates from protos/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_pinned_services_and_rpcs_exist():
    from rlfleet.proto import (
        refcritic_pb2,
        reward_pb2,
        rollout_pb2,
        trainer_pb2,
    )

    expected = {
        (rollout_pb2, "Rollout"): {
            "Generate",
            "UpdateWeights",
            "FlushCache",
            "Pause",
            "Resume",
            "GetStatus",
        },
        (rollout_pb2, "Router"): {"ListReplicas", "DrainReplica"},
        (reward_pb2, "Reward"): {"Score", "ScoreBatch", "ListScorers"},
        (refcritic_pb2, "RefCritic"): {
            "ComputeRefLogProbs",
            "ComputeValues",
            "UpdateCritic",
            "SaveCheckpoint",
            "LoadCheckpoint",
        },
        (trainer_pb2, "Trainer"): {
            "GetStatus",
            "Pause",
            "Resume",
            "SaveCheckpoint",
            "Stop",
            "StreamMetrics",
        },
    }
    for (module, service), methods in expected.items():
        descriptor = module.DESCRIPTOR.services_by_name[service]
        assert descriptor.full_name == f"rlfleet.v1.{service}"
        assert {m.name for m in descriptor.methods} == methods
