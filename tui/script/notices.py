"""What dptui says when a script ends about the DataParallel it did or did not see.

Empty panels and exit 0 tell a user nothing: the usual reasons are a wrap that only happens on
GPUs, an import that reaches torch's own class, or a class dptui does not record here (DDP).
Each sentence is one line, for stderr and for a `notice` event.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

DDP = "torch.nn.parallel.DistributedDataParallel"


def end_notices(built: Sequence[str], stepped: Collection[str], used: Collection[str], gpus: int,
                completed: bool = True) -> list[str]:
    """`built`: the DataParallel instances announced; `stepped`: those with a recorded step;
    `used`: classes the child said it built unrecorded (wire `used`); `gpus`: CUDA devices here;
    `completed`: the script ran to its end with status 0 (not stopped by dptui, not failed)."""
    notices = []
    if DDP in used:
        notices.append(f"the script built {DDP} in its own process, which dptui records only in ranks it "
                       "launches (dptui run --nproc-per-node N) or the script starts: its steps were not recorded")
    if not completed:
        return notices  # stopped or failed on the way: what it had not built yet tells nothing
    idle = [key for key in built if key not in stepped]
    if idle:
        one = len(idle) == 1
        notices.append(f"{', '.join(idle)} {'was' if one else 'were'} built but never stepped: dptui saw no "
                       f"forward of {'it' if one else 'them'} finish, so none was recorded")
    if not built and not used:
        where = "without a GPU" if gpus == 0 else "with one GPU" if gpus == 1 else f"here ({gpus} GPUs)"
        notices.append("the script built no torch.nn.DataParallel, so dptui recorded nothing: usually the "
                       "wrap sits under a condition that is false " + where + " (if torch.cuda.device_count() > 1, "
                       "if input.is_cuda), or the script imports DataParallel in a way dptui does not swap")
    return notices


# How a link to dptui is cut before its script's end, said after what the script closed.
CUT_HOW = ("(code that closes every fd above 2, os.closerange(3, ...), does) or left without Python's exit "
           "(os._exit); what it did after was not recorded")


def link_cut(steps: int) -> str:
    """The script ended well but its side channel to dptui did not last to its end (wire `closed`)."""
    return (f"the script's link to dptui was cut before the script ended, after {steps} recorded "
            f"step{'' if steps == 1 else 's'}: the script closed the link's pipe {CUT_HOW}")
