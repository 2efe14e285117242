"""The result of a run, its JSON file, and its presenters.

Modules; the presenters take a result, and the result imports none of them::

    _report     report(result): the settings against the defaults, the bottleneck, advice
    _plot       plot(result): the trials as a picture (matplotlib, optional)
    _progress   the progress bar of a running search
    _result     TuneResult: the tuned settings, their loader, save() and load()
    _record     TrialRecord: one measured setting
    _fields     a saved result's fields, each checked as it is read
    _files      a result's file: where one can be written, reading one safely
"""
