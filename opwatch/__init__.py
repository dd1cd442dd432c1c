"""opwatch: which op, on which line of your code, went wrong.

Watches every PyTorch op while a model runs and points at the op and the line that caused a
device mix, a silent float64 upcast, a broadcasting blowup, or the first nan/inf::

    import opwatch

    with opwatch.watch() as w:
        loss = model(x).sum()
        loss.backward()
    print(w.table(last=20))
    for anomaly in w.anomalies:
        print(anomaly)
"""

from .anomaly import Anomaly, AnomalyError, OpwatchWarning
from .notation import TensorMeta, format_meta
from .records import OpRecord
from .watch import Watch, strict, watch

__all__ = [
    "watch",
    "strict",
    "Watch",
    "OpRecord",
    "TensorMeta",
    "Anomaly",
    "AnomalyError",
    "OpwatchWarning",
    "format_meta",
]

__version__ = "0.1.0"
