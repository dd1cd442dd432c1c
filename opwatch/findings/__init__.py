"""Where findings become what users get: :mod:`.anomaly` (``Anomaly``, ``AnomalyError``),
:mod:`.report` (the one place a finding becomes an anomaly, a warning or a raise),
:mod:`.allow` (the allow-list) and :mod:`.ranks` (anomalies exchanged between ranks)."""
