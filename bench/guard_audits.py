"""opwatch.guard with audits over 200-step blocks of the tfm32 step vs eager and vs a guard that never audits, interleaved: python -m bench.guard_audits [ROUNDS]."""
import sys, time
from bench.contenders import guard_audit_split, AUDITED_STEPS, load_opwatch
from bench.timing import measure, paired_ratio
from bench.workloads import WORKLOADS
import torch
torch.set_num_threads(1)
opwatch, status = load_opwatch()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
step, contenders = guard_audit_split(opwatch, WORKLOADS["tfm32"].factory())
ms = measure(step, contenders, rounds, 1e9, time.process_time, max_steps=AUDITED_STEPS)
eager, audited, never = (ms[c.name] for c in contenders)
for c in contenders:
    m = ms[c.name]
    print(f"{c.name}: error={m.error} blocks={len(m.seconds)} steps/block={m.steps_per_block} median ms/step={sorted(m.seconds)[len(m.seconds)//2]*1e3:.3f}")
print(f"tfm32, {AUDITED_STEPS}-step blocks, {rounds} interleaved rounds, process CPU time, 1 thread, paired medians:")
print(f"  guard(audit='new') / eager = {paired_ratio(audited, eager):.3f}x (one audit per block included)")
print(f"  guard(audit='never') / eager = {paired_ratio(never, eager):.3f}x")
print(f"  guard(audit='new') / guard(audit='never') = {paired_ratio(audited, never):.3f}x (the audit's share)")
