"""Where a guarded compiled step's cost over the compiled step goes, on a GPU: lanes that add the
guard's parts one at a time, from no opwatch at all to the whole guard.

    python -m bench.gpu_floor small-fp32 5      # a workload of bench.gpu, 5 rounds of 100 steps
    python -m bench.gpu_floor large-bf16 3
    python -m bench.gpu_floor small-fp32 1 --cpu   # the same code on the CPU, tiny (aot_eager): a smoke run
    python -m bench.gpu_floor large-bf16 3 --fused # fused SGD, and a lane that decides on the device

Each lane is a compiled copy of the workload (``torch.compile``, inductor; ``aot_eager`` with
``--cpu``), stepped as ``bench.gpu`` steps it (``zero_grad``, the call, ``optimizer.step()``) and
timed as it times them (blocks of ten steps between two syncs, shuffled, one process):

- ``compiled``: the compiled step;
- ``one host read``: and ``float(loss)`` after the backward (no opwatch): the floor of any
  decision the host takes each step;
- ``kernel + read``: GradScaler's kernel over the gradients and one read of its flag (no opwatch):
  the floor of any check of every gradient on the host's word;
- ``snapshot + read``: the guard's start snapshot (RNG states, version counters) before the step,
  then the host read;
- ``check``: the guard's fused check (the loss's largest magnitude and the gradients, one read);
- ``snapshot + check``: both;
- ``guard``: ``opwatch.guard(step, model, audit="never")``.

With ``--fused`` every lane steps a fused SGD (``fused=True``) instead, and one more lane runs:

- ``kernel, flag to the optimizer``: GradScaler's kernel over the gradients into a flag that the
  fused optimizer reads as ``optimizer.found_inf`` (as GradScaler hands it over), so a step whose
  gradients hold nan/inf is skipped on the device, with no host read (no opwatch): what a
  leave-on that decides on the device, and reads its flag a step later, would cost at most.

Prints each lane's milliseconds per step (median over rounds) and its ratio over the compiled
lane (the median of the rounds' ratios).
"""

from __future__ import annotations

import statistics
import sys
import warnings

import torch

from bench.gpu import Lane, per_step, ratio, setup, timed_rounds, warm


def _lanes(parts, smoke: bool, fused: bool) -> list:
    import opwatch

    backend = "aot_eager" if smoke else "inductor"

    def lane(name, make=None):
        lane_parts = parts()
        if fused:
            lane_parts.optimizer = torch.optim.SGD(lane_parts.model.parameters(), lr=lane_parts.optimizer.defaults["lr"], fused=True)
        return Lane(name, lane_parts, module=torch.compile(lane_parts.model, backend=backend), make=make, fresh=False)

    def flag_to_the_optimizer(lane):
        params = list(lane.parts.model.parameters())
        found, one = torch.zeros(1, device=params[0].device), torch.ones(1, device=params[0].device)
        lane.parts.optimizer.found_inf = found  # read by the fused step: nonzero skips it on the device

        def call():
            loss = lane.forward_backward()
            found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_([param.grad for param in params], found, one)
            return loss

        return call

    def host_read(lane):
        return lambda: float(lane.forward_backward().detach())

    def guard_part(kind):
        def make(lane):
            guarded = opwatch.guard(lane.forward_backward, lane.parts.model, audit="never")
            if kind == "guard":
                return guarded
            guarded()  # its first call collects the parameters
            snapshots, check = guarded._snapshots, guarded.policy.verdict.returned
            params = snapshots.params
            found, one = torch.zeros(1, device=params[0].device), torch.ones(1, device=params[0].device)

            def kernel_and_read():
                loss = lane.forward_backward()
                torch._amp_foreach_non_finite_check_and_unscale_([param.grad for param in params], found, one)
                return found.item() == 0 and loss

            def snapshot_and_read():
                snapshots.take((), {})
                return float(lane.forward_backward().detach())

            def fused_check():
                return check.all_finite(lane.forward_backward(), params)

            def snapshot_and_check():
                snapshots.take((), {})
                return check.all_finite(lane.forward_backward(), params)

            return {"kernel + read": kernel_and_read, "snapshot + read": snapshot_and_read, "check": fused_check,
                    "snapshot + check": snapshot_and_check}[kind]

        return make

    kinds = ("kernel + read", "snapshot + read", "check", "snapshot + check", "guard")
    lanes = [lane("compiled"), lane("one host read", host_read)]
    if fused:
        lanes.append(lane("kernel, flag to the optimizer", flag_to_the_optimizer))
    return lanes + [lane(kind, guard_part(kind)) for kind in kinds]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    smoke, fused = "--cpu" in args, "--fused" in args
    args = [arg for arg in args if arg not in ("--cpu", "--fused")]
    workload = args[0] if args else "small-fp32"
    rounds = int(args[1]) if len(args) > 1 else 5
    if not smoke and not torch.cuda.is_available():
        print("bench.gpu_floor needs a CUDA device (--cpu: a smoke run on the CPU)", file=sys.stderr)
        return 2
    _, _, parts, sync = setup(workload, smoke)
    warnings.simplefilter("ignore")
    lanes = _lanes(parts, smoke, fused)
    warm(lanes, 5)
    timed_rounds(lanes, rounds, 100, 10, sync)
    base = lanes[0]
    where = "CPU (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"bench.gpu_floor on {where}, torch {torch.__version__}: {workload}, {rounds} rounds of 100 steps"
          + (", fused SGD" if fused else ", SGD"))
    for lane in lanes:
        if lane.error:
            print(f"{lane.name:<30} failed: {lane.error}")
            continue
        print(f"{lane.name:<30} {statistics.median(per_step(lane)) * 1e3:8.3f} ms/step  x compiled {ratio(lane, base) or 1.0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
