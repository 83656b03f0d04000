"""Many runs compared: what a sweep's job returns, searches, reading run folders, reports. May import
``rlhf.run`` and below; never ``rlhf.config`` or ``rlhf.launch``.

- :mod:`~rlhf.sweeps.points`: the objective a job returns to Hydra, points that fail without ending the sweep.
- :mod:`~rlhf.sweeps.search`: a search over a grid per option, chosen on validation, rerun on fresh seeds.
- :mod:`~rlhf.sweeps.results`: run folders read back (status, metrics, config) for reports and scripts.
- :mod:`~rlhf.sweeps.report`, :mod:`~rlhf.sweeps.tables`, :mod:`~rlhf.sweeps.plots`: the comparison report (its
  rows; their text, rounded, and a note on runs that did not run alike; the curves); :mod:`~rlhf.sweeps.caveats`:
  its notes on speeds measured beside different loads and on curves of too few points.
- :mod:`~rlhf.sweeps.bf16_note`: the report's note on learning rates compared where bf16 hides their updates.
"""
