"""Realistic wrong answers to lab 4, one small slip each (importable: the checks run them on
spawned ranks), and correct alternatives that must pass."""

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.course.labs import lab4


# -- forward ------------------------------------------------------------------------------------
def forward_never_frees(unit, x):
    unit.gather()
    return unit.module(x)


def forward_frees_before_running(unit, x):
    unit.gather()
    unit.free()
    return unit.module(x)


def forward_never_gathers(unit, x):
    out = unit.module(x)
    unit.free()
    return out


def forward_under_no_grad(unit, x):  # "we only need the values here"
    unit.gather()
    with torch.no_grad():
        out = unit.module(x)
    unit.free()
    return out


def forward_returns_detached(unit, x):  # detached so the freed weights are "not referenced"
    unit.gather()
    out = unit.module(x).detach()
    unit.free()
    return out


def forward_calls_the_forward_method(unit, x):  # right output, but module hooks do not run
    unit.gather()
    out = unit.module.forward(x)
    unit.free()
    return out


def forward_gathers_async_never_waits(unit, x):  # computes while the weights may still be arriving
    unit.gather(async_op=True)
    out = unit.module(x)
    unit.free()
    return out


def forward_gathers_async_and_waits(unit, x):  # correct: start, then wait, then run
    unit.gather(async_op=True)
    unit.gather()
    out = unit.module(x)
    unit.free()
    return out


def forward_starts_then_wait_gather(unit, x):  # correct: the wait FlatUnit.gather itself makes
    unit.gather(async_op=True)
    unit.wait_gather()
    out = unit.module(x)
    unit.free()
    return out


def forward_gathers_twice(unit, x):  # correct, if redundant: a gathered unit's gather() does nothing
    unit.gather()
    unit.gather()
    out = unit.module(x)
    unit.free()
    return out


def forward_gathers_async_positionally(unit, x):  # gather(True): async_op is keyword-only
    unit.gather(True)
    out = unit.module(x)
    unit.free()
    return out


# -- prepare_backward ---------------------------------------------------------------------------
def prepare_backward_no_regather(unit, out):
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_frees_at_first_gradient(unit, out):
    out.register_hook(lambda grad: unit.gather())
    # the last parameter's gradient comes first: the rest of the unit's backward still needs the weights
    unit.params[-1].register_post_accumulate_grad_hook(lambda p: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_method_as_hook(unit, out):  # autograd calls it with the gradient
    out.register_hook(unit.gather)
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_never_frees(unit, out):
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, lambda: lab4.reduce_grads(unit))


def prepare_backward_no_reduce(unit, out):
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, unit.free)


def prepare_backward_gathers_at_once(unit, out):  # gathered now, not when backward arrives
    unit.gather()
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_permanent_hooks(unit, out):  # lab 3's re-armed countdown, registered every step
    out.register_hook(lambda grad: unit.gather())
    left = [len(unit.params)]

    def hook(p):
        left[0] -= 1
        if left[0] == 0:
            left[0] = len(unit.params)
            lab4.reduce_grads(unit)
            unit.free()

    for p in unit.params:
        p.register_post_accumulate_grad_hook(hook)


def prepare_backward_passes_the_result(unit, out):  # calls reduce_grads now: passes a tensor, not a function
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, lab4.reduce_grads(unit))


def prepare_backward_gathers_async(unit, out):  # starts the gather for backward, never waits for it
    out.register_hook(lambda grad: unit.gather(async_op=True))
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_full_backward_hook(unit, out):  # fires when the input's gradient is ready
    out.register_hook(lambda grad: unit.gather())

    def after_backward(module, grad_input, grad_output):
        lab4.reduce_grads(unit)
        unit.free()

    unit.module.register_full_backward_hook(after_backward)


def prepare_backward_hook_returns_a_tuple(unit, out):  # a lambda returns its tuple: it replaces the gradient
    out.register_hook(lambda grad: unit.gather())
    unit.module.register_full_backward_hook(lambda module, grad_in, grad_out: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_multi_grad_hook(unit, out):  # tensor hooks inside: before the last p.grad is stored
    out.register_hook(lambda grad: unit.gather())
    torch.autograd.graph.register_multi_grad_hook(unit.params, lambda grads: (lab4.reduce_grads(unit), unit.free()))


def _own_reduce_scatter(unit, reduce_scatter):
    full = unit.pack_grads(torch.float32)
    unit.set_param_grads(None)
    shard = torch.empty(unit.shard_numel)
    reduce_scatter(shard, full)
    return shard


def prepare_backward_own_reduce_scatter(unit, out):  # correct: comm.reduce_scatter, no unit= keyword
    out.register_hook(lambda grad: unit.gather())

    def after():
        unit.master.grad = _own_reduce_scatter(unit, comm.reduce_scatter) / unit.world_size
        unit.free()

    lab4.on_grads_ready(unit, after)


def prepare_backward_torch_reduce_scatter(unit, out):  # correct: torch.distributed itself
    out.register_hook(lambda grad: unit.gather())

    def after():
        unit.master.grad = _own_reduce_scatter(unit, dist.reduce_scatter_tensor) / unit.world_size
        unit.free()

    lab4.on_grads_ready(unit, after)


def prepare_backward_drops_the_shard(unit, out):  # lab 3's reduce_unit reused: its shard returned, then dropped
    out.register_hook(lambda grad: unit.gather())

    def after():
        _own_reduce_scatter(unit, comm.reduce_scatter)
        unit.free()

    lab4.on_grads_ready(unit, after)


def prepare_backward_starts_then_waits(unit, out):  # correct: gather(async_op=True), then wait_gather()
    def borrow(grad):
        unit.gather(async_op=True)
        unit.wait_gather()

    out.register_hook(borrow)
    lab4.on_grads_ready(unit, lambda: (lab4.reduce_grads(unit), unit.free()))


def prepare_backward_free_then_reduce(unit, out):  # correct: PyTorch FSDP2's order
    out.register_hook(lambda grad: unit.gather())
    lab4.on_grads_ready(unit, lambda: (unit.free(), lab4.reduce_grads(unit)))


FORWARD, BACKWARD = "lab4.forward", "lab4.prepare_backward"
WRONG = {  # case: (task, wrong answer, the mistake the check must name, words its hint must contain)
    "never frees after forward": (FORWARD, forward_never_frees, "not_freed", "still holds its full weights"),
    "frees before the forward ran": (FORWARD, forward_frees_before_running, "freed_before_forward",
                                     "blocks.0's forward ran after you freed it"),
    "never gathers": (FORWARD, forward_never_gathers, "never_gathered", "blocks.0's forward ran on freed weights"),
    "calls module.forward": (FORWARD, forward_calls_the_forward_method, "forward_not_called",
                             "skips a module's hooks"),
    "async gather never waited for": (FORWARD, forward_gathers_async_never_waits, "used_in_flight",
                                      "still in flight"),
    "forward under no_grad": (FORWARD, forward_under_no_grad, "no_graph", "no autograd graph"),
    "forward returns a detached output": (FORWARD, forward_returns_detached, "no_graph", "no autograd graph"),
    "gather(True) in forward": (FORWARD, forward_gathers_async_positionally, "positional_async",
                                "async_op by keyword"),
    "not re-gathered for backward": (BACKWARD, prepare_backward_no_regather, "backward_on_freed",
                                     "blocks.3's backward ran on freed weights"),
    "freed before its backward finished": (BACKWARD, prepare_backward_frees_at_first_gradient, "freed_too_early",
                                           "was freed while 5 of its 6 gradients were still to come"),
    "a full backward hook frees the unit": (BACKWARD, prepare_backward_full_backward_hook, "freed_too_early",
                                            "a module's full backward hook runs when the gradient of its input"),
    "a multi-grad hook frees the unit": (BACKWARD, prepare_backward_multi_grad_hook, "freed_too_early",
                                         "register_multi_grad_hook runs before the last p.grad is stored"),
    "a backward hook that returns a tuple": (BACKWARD, prepare_backward_hook_returns_a_tuple, "hook_returned",
                                            "what a backward hook returns replaces the gradient"),
    "passes reduce_grads' result as the function": (BACKWARD, prepare_backward_passes_the_result, "hook_not_callable",
                                                    "raised while backward ran a hook you registered"),
    "gathers for backward without waiting": (BACKWARD, prepare_backward_gathers_async, "used_in_flight",
                                             "backward started while its gather was still in flight"),
    "the method itself as the hook": (BACKWARD, prepare_backward_method_as_hook, "method_as_hook",
                                      "Wrap it: out.register_hook(lambda grad: unit.gather())"),
    "never freed after backward": (BACKWARD, prepare_backward_never_frees, "not_freed_after_backward",
                                   "after backward, blocks.0 still holds its full weights"),
    "gradients never reduced": (BACKWARD, prepare_backward_no_reduce, "no_reduce", "has no gradient shard"),
    "reduce-scattered, the shard dropped": (BACKWARD, prepare_backward_drops_the_shard, "shard_not_kept",
                                           "blocks.0's gradients were reduce-scattered, but it has no gradient shard"),
    "gathered again at once": (BACKWARD, prepare_backward_gathers_at_once, "gathered_too_early",
                               "4 units held their full weights at once"),
    "hooks registered every step": (BACKWARD, prepare_backward_permanent_hooks, "hooks_pile_up",
                                    "in step 2, blocks.0's gradients were reduce-scattered 2 times"),
}
ON_THREE: dict = {}
CORRECT = {
    "forward starts the gather, then waits": (FORWARD, forward_gathers_async_and_waits),
    "forward gathers twice": (FORWARD, forward_gathers_twice),
    "forward starts the gather, then wait_gather()": (FORWARD, forward_starts_then_wait_gather),
    "backward gather started, then wait_gather()": (BACKWARD, prepare_backward_starts_then_waits),
    "its own reduce-scatter, comm without unit=": (BACKWARD, prepare_backward_own_reduce_scatter),
    "its own reduce-scatter, torch.distributed": (BACKWARD, prepare_backward_torch_reduce_scatter),
    "free before reduce-scatter (FSDP2's order)": (BACKWARD, prepare_backward_free_then_reduce),
}
