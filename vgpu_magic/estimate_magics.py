"""``%%vgpu_estimate``: a thin face over :func:`vgpu_magic.memory_estimate.estimate`; its line is checked first."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import Pretty, display

from .errors import PlanError, excerpt
from .grammar import framework_name, parse_arguments, usage_errors, whole, with_example
from .memory_estimate import GPU_MODELS, MAX_ALL_RANKS, MemoryEstimate, estimable, estimate, parse_gpu


@with_example("--gpu 80GB")
def _gpu(text: str) -> str:
    with usage_errors(PlanError, into=argparse.ArgumentTypeError):
        parse_gpu(text)
    return text


_ESTIMABLE = " or ".join(estimable())
_RANKS, _RANK = whole("--ranks", 1, 2**20, "--ranks 8"), whole("--rank", 0, 2**20, "--rank 0")


@magics_class
class EstimateMagics(Magics):
    """``%%vgpu_estimate``: the face of :func:`estimate`."""

    @cell_magic
    @magic_arguments()
    @argument("--ranks", "-n", type=_RANKS, metavar="N", help="ranks; default: the count in --gpu 8x80GB, else 1")
    @argument("--gpu", "-g", type=_gpu, metavar="SIZE", help=f"80GB, 8x80GB or a model ({', '.join(GPU_MODELS)})")
    @argument("--rank", "-r", type=_RANK, default=0, metavar="R", help="the rank to run as (default 0)")
    @argument("--all-ranks", "-a", action="store_true", help=f"run as every rank (at most {MAX_ALL_RANKS})")
    @argument("--framework", "-f", type=framework_name, metavar="NAME", help=f"{_ESTIMABLE}; default: the cell's")
    @argument("-o", dest="output", metavar="NAME", help="store the MemoryEstimate in this variable too")
    def vgpu_estimate(self, line: str, cell: str) -> MemoryEstimate:
        """Estimate each rank's peak memory for a cell that builds a model and runs a
        training step on N devices, without allocating its tensors.

        In [1]: %%vgpu_estimate --ranks 8 --gpu 80GB
           ...: model = Net(); fully_shard(model); model(x).sum().backward(); opt.step()
        """
        __tracebackhide__ = True  # a failing cell is shown in its own lines (estimate() keeps only those)
        with usage_errors(PlanError):
            args = parse_arguments(self.vgpu_estimate.parser, line, example="%%vgpu_estimate --ranks 8 --gpu 80GB")
            if args.output is not None and not args.output.isidentifier():
                raise PlanError(f"-o {excerpt(args.output)} is not a variable name; use e.g. -o fit")
            options = {k: v for k, v in vars(args).items() if k != "output"}  # estimate's own keywords
        # A run takes minutes: a line says what runs, empty before and after (nbval reads no display updates).
        shown = display(Pretty(""), display_id=True)
        try:
            found = estimate(cell, **options, namespace=self.shell.user_ns, progress=lambda t: shown.update(Pretty(t)))
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        finally:
            shown.update(Pretty(""))
        if args.output:
            self.shell.user_ns[args.output] = found
        return found
