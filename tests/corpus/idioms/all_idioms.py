"""Every idiom that needs no job of its own, one after the other in one job, in each launcher's
one launch: the group comes from corpus_start, then each idiom's exercise() in turn, each
announced by a line of its own; the plain idioms and the library's (run with the library
installed in site-packages: tests/test_corpus.py). One launch under each launcher instead of
one each (a pair of launches is 5-12 s of CPU, mostly torch's import). The idioms that run
elsewhere change what every later line would meet (own_signals: the script's signal handlers,
one installed before the group; exit_three: a rank exits 3; both in lib_timm.py's script)
or join through the library's own init helper (lib_timm's script, the library on PYTHONPATH;
never_ddpkit's, which never calls ddpkit and joins through torchvision's, the library
installed editable).

async_keywords is the first with a collective: keyword and ``async_op=True`` calls are the
job's first collectives, as in a script of their own. compile_collective compiles late, so no
plain idiom before it runs with dynamo imported; the library's idioms follow it, in the order
they had in a job of their own (transformers' sets up logging for the rest of the process),
torchvision's last of them: its setup_for_distributed silences print on the non-master ranks,
for the rest of the process as in its train.py, so its section ends by putting the builtin
back (what the script's print was before), and every rank prints again. own_destroy is the
last: the script destroys the group itself (under both launchers, instead of corpus_start's
finish()), then works on alone and exits, which is where its tutorial has it.
"""

from __future__ import annotations

import builtins

import async_keywords
import collective_signatures
import compile_collective
import dataloader_fork
import gan_penalty
import lib_accelerate
import lib_timm
import lib_torchvision
import lib_transformers
import lib_yolov5
import own_destroy
import progress_bar
import subgroups
from corpus_start import start
from ddpkit_idiomlib import torchvision_utils

IDIOMS = (
    collective_signatures,
    async_keywords,
    gan_penalty,
    subgroups,
    dataloader_fork,
    progress_bar,
    compile_collective,
    lib_accelerate,
    lib_transformers,
    lib_yolov5,
    lib_timm,
)

if __name__ == "__main__":
    rank, world_size = start()
    for idiom in IDIOMS:
        print(f"--- {idiom.__name__}", flush=True)
        idiom.exercise(rank, world_size)
    print("--- lib_torchvision", flush=True)
    script_print = builtins.print
    torchvision_utils.setup_for_distributed(rank == 0)
    lib_torchvision.exercise(rank, world_size)
    builtins.print = script_print
    print("--- own_destroy", flush=True)
    own_destroy.exercise(rank, world_size)  # last: it destroys the group
