"""The plain idioms that need no job of their own, one after the other in one job: the group
comes from corpus_start, then each idiom's exercise() in turn, each announced by a line of its
own. One launch under each launcher instead of one each (a pair of launches is 5-12 s of CPU,
mostly torch's import). The idioms that keep a job of their own change what every later line
would meet (own_signals: the script's signal handlers; own_destroy: the script destroys the
group; exit_three: a rank exits 3; never_ddpkit: no ddpkit.init(); compile_collective: a
compile, with its own first collective).

async_keywords is the first with a collective: keyword and ``async_op=True`` calls are the
first a wrapper of the collectives meets, as in a script of their own.
"""

from __future__ import annotations

import async_keywords
import collective_signatures
import dataloader_fork
import gan_penalty
import progress_bar
import subgroups
from corpus_start import finish, start

IDIOMS = (
    collective_signatures,
    async_keywords,
    gan_penalty,
    subgroups,
    dataloader_fork,
    progress_bar,
)

if __name__ == "__main__":
    rank, world_size = start()
    for idiom in IDIOMS:
        print(f"--- {idiom.__name__}", flush=True)
        idiom.exercise(rank, world_size)
    finish()
