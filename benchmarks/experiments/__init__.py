"""One-off GPU experiments behind figures in ``benchmarks/RESULTS.md`` and
``benchmarks/NOTES.md``: ``python -m benchmarks.experiments.<name>`` from the
repository root (``bash benchmarks/device_all.sh <name>`` on the device
machine).  Each module stands alone; see ``README.md`` here."""
