"""The plain idioms that need no job of their own, one after the other in one job: the group
comes from corpus_start, then each idiom's exercise() in turn, each announced by a line of its
own. One launch under each launcher instead of one each (a pair of launches is 5-12 s of CPU,
mostly torch's import). The idioms that keep a job of their own change what every later line
would meet (own_signals: the script's signal handlers, one installed before the group;
exit_three: a rank exits 3; never_ddpkit: no ddpkit.init()).

async_keywords is the first with a collective: keyword and ``async_op=True`` calls are the
job's first collectives, as in a script of their own. compile_collective compiles
late, so no idiom before it runs with dynamo imported; own_destroy is the last: the script
destroys the group itself (under both launchers, instead of corpus_start's finish()), then
works on alone and exits, which is where its tutorial has it.
"""

from __future__ import annotations

import async_keywords
import collective_signatures
import compile_collective
import dataloader_fork
import gan_penalty
import own_destroy
import progress_bar
import subgroups
from corpus_start import start

IDIOMS = (
    collective_signatures,
    async_keywords,
    gan_penalty,
    subgroups,
    dataloader_fork,
    progress_bar,
    compile_collective,
    own_destroy,  # last: it destroys the group
)

if __name__ == "__main__":
    rank, world_size = start()
    for idiom in IDIOMS:
        print(f"--- {idiom.__name__}", flush=True)
        idiom.exercise(rank, world_size)
