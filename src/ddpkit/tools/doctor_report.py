"""What a ``ddpkit doctor`` run is asked (:class:`DoctorOptions`) and what it produces
(:class:`Report`: the check lines, the all_reduce rows, the references), shared by the doctor
(:mod:`.doctor`) and its communication step (:mod:`.commrun`), which fills the report in.
Stdlib only: the two depend on this module, not on each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.masking import mask_text, mask_tree
from ddpkit.tools.doctor_checks import Check

__all__ = ["DEFAULT_TIMEOUT_S", "DoctorOptions", "Report"]

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DoctorOptions:
    """What ``ddpkit doctor``'s flags ask for."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    quick: bool = False
    comm: bool = True
    folders: tuple[str, ...] = ()
    min_free_gb: float = 1.0
    world_size: int | None = None  # size the limits for this many ranks (default: the job's)


@dataclass
class Report:
    """The checks (one line each), the sweep rows and the references (rank 0's view)."""

    rank: int
    checks: list[Check]
    allreduce: list[dict[str, Any]]
    references: dict[str, float | None]

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)

    def text(self, *, problems_only: bool = False) -> str:
        """The check lines (only WARN/FAIL with ``problems_only``), then the sweep's table."""
        lines = [
            mask_text(c.line()) for c in self.checks if c.status != "PASS" or not problems_only
        ]
        if self.allreduce:
            lines.append(
                f"{'backend':>8} {'size (B)':>10} {'time (us)':>11} "
                f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
            )
            lines += [
                f"{r['backend']:>8} {r['size_bytes']:>10} {r['time_us']:>11.1f} "
                f"{r['algbw_gbps']:>13.3f} {r['busbw_gbps']:>13.3f}"
                for r in self.allreduce
            ]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "ok": not self.failed,
                "checks": [mask_tree(asdict(c)) for c in self.checks],
                "allreduce": self.allreduce,
                "references": self.references,
            }
        )
