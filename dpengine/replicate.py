"""Replicate a module to each device for one forward.

CUDA: torch's own `replicate` (Broadcast, whose backward reduce-adds the gradients
onto device_ids[0]). Virtual CPU devices: shallow copies whose parameters are views
of the original Parameters, made by one autograd function per replica
(`SharedParameters`: torch's Broadcast without the copy). As in torch, replica
parameters are non-leaf tensors with a grad_fn, held as plain attributes (so
`replica.parameters()` is empty and `replica.zero_grad()` only warns), and every
trainable parameter gets a gradient once the replica's backward runs, zeros for one
its output did not use. Autograd sums the replicas' gradients into the originals.
Buffers follow torch: replica 0 shares the original's (BatchNorm statistics persist
from the first chunk), the others get their own copies, so no two threads update one
buffer.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.nn.parallel import replicate as _cuda_replicate
from torch.nn.parameter import is_lazy

from .device_random import draws_randomness
from .devices import DeviceLike, parse_device

# Bumped whenever any module registers a parameter, buffer or submodule: a module's structure
# can only change through one of those, so a plan built at the same generation still holds.
_generation = [0]


def _bump(*_: Any) -> None:
    _generation[0] += 1


for _register in (register_module_parameter_registration_hook,
                  register_module_buffer_registration_hook,
                  register_module_module_registration_hook):
    _register(_bump)


def structure_generation() -> int:
    """A number that changes whenever any module's parameters, buffers or submodules change."""
    return _generation[0]


def replicate(network: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """torch.nn.parallel.replicate's signature; also takes virtual CPU devices ("cpu:N")."""
    if not devices:
        return []
    parsed = [parse_device(d) for d in devices]
    if parsed[0].type == "cuda":
        return replicate_cuda(network, [d.index for d in parsed], detach=detach)
    return replicate_shared(network, len(parsed), detach=detach)


def replicate_from_source(replicate_fn: Callable[[nn.Module, list], list[nn.Module]], module: nn.Module,
                          source: DeviceLike, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
    """replicate_fn(module, device_ids), broadcast from `source` (where the parameters live).

    torch's Broadcast (comm.broadcast_coalesced) refuses a device list whose first entry is
    not where the tensors are: a split that leaves `source` no rows would fail every step. The
    replica made on `source` for that is dropped.
    """
    device_ids = list(device_ids)
    if not device_ids or device_ids[0] == source:
        return replicate_fn(module, device_ids)
    return replicate_fn(module, [source, *device_ids])[1:]


def is_compiled(module: nn.Module) -> bool:
    """Whether module is torch.compile's wrapper (OptimizedModule); without importing dynamo."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compiled_replica(wrapper: nn.Module, inner: nn.Module) -> nn.Module:
    """A replica of a torch.compile'd module whose forward compiles `inner`, a replica of what it wraps.

    Not OptimizedModule._replicate_for_data_parallel: its __setattr__ passes `_parameters` and
    `_modules` on to the wrapped module, so torch's replicate empties the user's model and makes
    it its own child (endless recursion in every replica, under torch's DataParallel too).
    """
    state = wrapper.__dict__.copy()
    state["_modules"] = {**wrapper._modules, "_orig_mod": inner}
    state["_parameters"] = {}
    state["_buffers"] = wrapper._buffers.copy()
    state["_is_replica"] = True
    replica = wrapper.__new__(type(wrapper))
    object.__setattr__(replica, "__dict__", state)
    replica._initialize()
    return replica


def replicate_cuda(network: nn.Module, device_ids: list[int], detach: bool = False) -> list[nn.Module]:
    """torch's replicate, and for a torch.compile'd network compiled replicas of what it wraps."""
    if not is_compiled(network):
        if any(is_compiled(m) for m in network.modules()):
            raise ValueError(
                "a torch.compile'd submodule cannot be replicated on CUDA (torch's replicate would "
                "rewrite it): compile the whole model, DataParallel(torch.compile(model)), or compile "
                "the submodules' forward functions instead"
            )
        return _cuda_replicate(network, device_ids, detach=detach)
    inner = _cuda_replicate(network._orig_mod, device_ids, detach=detach)
    return [compiled_replica(network, r) for r in inner]


class SharedParameters(torch.autograd.Function):
    """One replica's views of the shared Parameters; their gradients go back to the originals.

    Like torch's Broadcast, its backward runs once any output was used, and hands zeros to
    the parameters the replica did not use (autograd materializes the missing gradients).
    """

    @staticmethod
    def forward(ctx, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Returned as they are, autograd makes each output a view of its input in C++: no
        # Python call per parameter, and no op that lets go of the GIL (in a worker, each
        # such op hands it to another replica's thread and waits to get it back).
        return params

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        big = ctx.big
        if big and not torch.is_grad_enabled():  # under create_graph grads must keep their graph
            grads = list(grads)
            for i in big:
                grads[i] = _summable(grads[i])
        done = ctx.on_backward  # the recorder's "this replica's backward is over", if it set one
        if done is not None:
            done()
        return tuple(grads)


# The ctx is the autograd node. Class defaults, so a replica nobody records costs nothing:
# `big`, the positions of parameters whose gradients are worth summing in place (set per node
# by replicate_shared); `on_backward`, set by the recorder.
SharedParameters._backward_cls.big = ()
SharedParameters._backward_cls.on_backward = None

# Function.apply's Python wrapper first unwraps functorch's dead wrappers in every argument (a
# pytree walk); the C++ apply under it is a third cheaper, and right unless a functorch
# transform is active.
_apply_shared = super(torch.autograd.Function, SharedParameters).apply


def _shared_views(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if torch._C._are_functorch_transforms_active():
        return SharedParameters.apply(*params)
    return _apply_shared(*params)


# Below this many elements the extra tensor is not worth the Python calls that avoid it.
MIN_SUMMED_ELEMENTS = 1 << 18


def _summable(grad: torch.Tensor | None) -> torch.Tensor | None:
    # Autograd sums the replicas' gradients of a Parameter in place into the first one only if
    # that one holds its storage alone. A Linear weight's gradient is a view (t() of the
    # matmul's result) sharing its base's storage, so the first sum was a new tensor: three
    # weight-sized gradients alive at once where two do. The same storage without the base
    # lets the first gradient become the running sum. Only whole-storage views: a slice of a
    # bigger tensor would keep all of it alive as the parameter's .grad.
    if grad is not None and grad._is_view() and grad._base.numel() == grad.numel():
        return grad.detach()
    return grad


class ReplicationPlan:
    """What replicating a module needs that depends only on its structure, built once per structure."""

    def __init__(self, module: nn.Module) -> None:
        self.generation = structure_generation()
        self.modules = list(module.modules())
        position = {id(m): i for i, m in enumerate(self.modules)}
        self.params = list(module.parameters())
        # A lazy module not yet run: replicating it raises torch's own error (see replicate_shared).
        self.uninitialized = next((m for m in self.modules if any(
            is_lazy(t) for t in itertools.chain(m._parameters.values(), m._buffers.values()))), None)
        # Whether a virtual device's replica gets its own generator (None: the first training forward sees).
        self.random = draws_randomness(self.modules)
        # Whether any gradient is big enough for where it is made and summed to matter (see _bind).
        self.has_big = any(not is_lazy(p) and p.numel() >= MIN_SUMMED_ELEMENTS for p in self.params)
        index = {id(p): i for i, p in enumerate(self.params)}
        # per module: (attribute, index into params, None for a None entry)
        self.assignments = [
            tuple((key, None if p is None else index[id(p)]) for key, p in m._parameters.items())
            for m in self.modules
        ]
        self.children = [
            tuple((key, None if c is None else position[id(c)]) for key, c in m._modules.items())
            for m in self.modules
        ]
        self.sizes = [(len(m._parameters), len(m._buffers), len(m._modules)) for m in self.modules]
        # torch.compile'd modules: copied plainly (their own _replicate_for_data_parallel would
        # write into the module they wrap, see compiled_replica), their forward bound afresh.
        self.compiled = [i for i, m in enumerate(self.modules) if is_compiled(m)]
        self.general = [
            (type(m).__setattr__ is not _MODULE_SETATTR
             or type(m)._replicate_for_data_parallel is not _MODULE_REPLICATE) and i not in self.compiled
            for i, m in enumerate(self.modules)
        ]

    def current(self) -> bool:
        """Whether the module still has this structure (cheap: no walk of the module tree)."""
        return self.generation == structure_generation()

    def unchanged_and_on(self, device: torch.device) -> bool:
        """Every parameter and buffer on `device` (CPU: any virtual device), and no entry deleted.

        One pass over the plan's live dicts: `.to()` shows here, and so does a `del` of a
        parameter, buffer or submodule (which no registration hook reports).
        """
        cuda = device.type == "cuda"
        for m, size in zip(self.modules, self.sizes):
            params, buffers = m._parameters, m._buffers
            if (len(params), len(buffers), len(m._modules)) != size:
                return False
            for tensor in itertools.chain(params.values(), buffers.values()):
                if tensor is not None and (
                    tensor.device.type != device.type or (cuda and tensor.device != device)
                ):
                    raise WrongDevice(tensor.device)
        return True


class WrongDevice(Exception):
    """A parameter or buffer of the module is not on device_ids[0]."""

    def __init__(self, found: torch.device) -> None:
        super().__init__(str(found))
        self.found = found


def replicate_shared(
    module: nn.Module, count: int, plan: ReplicationPlan | None = None, detach: bool = False,
    nodes: list[Any] | None = None, binders: list[Callable[[], Any]] | None = None,
) -> list[nn.Module]:
    """`count` replicas of module whose parameters are views of its own (CPU).

    `nodes`, if given, receives each replica's SharedParameters autograd node (None without one).
    `binders`, if given, receives instead one function per replica (None without trainable
    parameters) that makes its views and returns its node: to be called in the thread that runs
    the replica, before its forward, so that the node's autograd sequence number ranks it with
    the replica's own nodes (see _bind).
    """
    if plan is None or not plan.current():
        plan = ReplicationPlan(module)
    if plan.uninitialized is not None:
        plan.uninitialized._replicate_for_data_parallel()  # "Modules with uninitialized parameters..."
    params = plan.params
    differentiable = not detach and torch.is_grad_enabled()
    trainable = [i for i, p in enumerate(params) if p.requires_grad] if differentiable else []
    slot = {i: k for k, i in enumerate(trainable)}
    shared = [params[i] for i in trainable]
    big = tuple(k for k, p in enumerate(shared) if p.numel() >= MIN_SUMMED_ELEMENTS)
    base = [p.detach() for p in params] if detach else list(params)
    replicas = []
    for r in range(count):
        copies = [
            _copy(m, r == 0, assigns, base, general)
            for m, assigns, general in zip(plan.modules, plan.assignments, plan.general)
        ]
        for copy, children in zip(copies, plan.children):
            modules = copy._modules
            for name, i in children:
                modules[name] = None if i is None else copies[i]
        for i in plan.compiled:
            copies[i]._initialize()  # its forward: the compiled call of its own replica inside
        replicas.append(copies[0])
        if not trainable:
            if binders is not None:
                binders.append(None)
            elif nodes is not None:
                nodes.append(None)
            continue
        targets = [
            (copy if general else copy.__dict__, general, key, slot[i])
            for copy, assigns, general in zip(copies, plan.assignments, plan.general)
            for key, i in assigns if i in slot
        ]
        bind = partial(_bind, shared, big, targets)
        if binders is not None:
            binders.append(bind)
        else:
            node = bind()
            if nodes is not None:
                nodes.append(node)
    return replicas


def _bind(shared: list[torch.Tensor], big: tuple[int, ...], targets: list[tuple]) -> Any:
    """Give one replica its views of the shared parameters; returns their autograd node.

    Autograd runs a CPU backward's ready nodes highest sequence number first, and numbers count
    per thread. Made in the replica's worker just before its forward, the node ranks below the
    replica's own nodes and above the next replica's (parallel_apply staggers the workers'
    numbers), so it runs as soon as the replica's gradients are all in and hands them to the
    parameters. Made in the caller, it could wait behind other replicas' backward, keeping every
    gradient of its replica alive meanwhile (mlp, 4 replicas: peak RSS 1.03x -> 1.14x of one
    replica, glibc's mmap threshold fixed).
    """
    views = _shared_views(shared)
    node = views[0].grad_fn
    if big:
        node.big = big
    for target, general, key, k in targets:
        if general:
            setattr(target, key, views[k])
        else:
            target[key] = views[k]
    return node


_MODULE_SETATTR = nn.Module.__setattr__
_MODULE_REPLICATE = nn.Module._replicate_for_data_parallel


def _copy(
    module: nn.Module, share_buffers: bool, assigns: tuple, values: list[torch.Tensor], general: bool
) -> nn.Module:
    """A shallow replica of `module` alone: parameters as plain attributes, buffers shared or cloned."""
    buffers = (
        module._buffers.copy() if share_buffers
        else {name: None if buf is None else buf.clone() for name, buf in module._buffers.items()}
    )
    if general:
        # A class that customises either gets the general path, through its own methods
        # (RNNBase's __setattr__ keeps its _flat_weights in step, for one).
        copy = module._replicate_for_data_parallel()
        copy._buffers = buffers
        for key, i in assigns:
            if i is None:
                copy._parameters[key] = None
            else:
                # A Parameter would be registered on the copy (and bump the structure
                # generation): a frozen or no-grad parameter goes in as a plain tensor, as torch's.
                value = values[i]
                setattr(copy, key, value.detach() if isinstance(value, nn.Parameter) else value)
        return copy
    # What Module._replicate_for_data_parallel plus the assignments above leave, built in one go:
    # nn.Module.__setattr__ is slow and these keys never hold a parameter, buffer or module.
    state = module.__dict__.copy()
    parameters = {}
    for key, i in assigns:
        if i is None:
            parameters[key] = None
        else:
            state[key] = values[i]
    state["_parameters"] = parameters
    state["_buffers"] = buffers
    state["_modules"] = module._modules.copy()
    state["_is_replica"] = True
    copy = module.__new__(type(module))
    object.__setattr__(copy, "__dict__", state)
    return copy
