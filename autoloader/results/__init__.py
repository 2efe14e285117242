"""The result of a run, its JSON file, and its presenters.

Modules; the presenters take a result, and the result imports none of them::

    _report     report(result): the settings against the defaults, the bottleneck, advice
    _plot       plot(result): the trials as a picture (matplotlib, optional)
    _progress   the progress bar of a running search
    _result     TuneResult and TrialRecord, their JSON file (save, load), the loader
"""
