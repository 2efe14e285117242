import autoloader


def test_public_names_change_only_on_purpose() -> None:
    assert set(autoloader.__all__) == {
        "AllSettingsFailedError",
        "AutoloaderError",
        "BaselineError",
        "Diagnosis",
        "Environment",
        "EnvironmentMismatchWarning",
        "InvalidInputError",
        "IsolationError",
        "LoopError",
        "ResultFileError",
        "SearchSpace",
        "TrialRecord",
        "TuneResult",
        "UnpicklableError",
        "__version__",
        "diagnose",
        "load",
        "tune",
    }
    for name in autoloader.__all__:
        assert getattr(autoloader, name) is not None


def test_errors_share_one_root() -> None:
    for name in (
        "AllSettingsFailedError",
        "BaselineError",
        "InvalidInputError",
        "IsolationError",
        "LoopError",
        "ResultFileError",
        "UnpicklableError",
    ):
        assert issubclass(getattr(autoloader, name), autoloader.AutoloaderError)
    assert issubclass(autoloader.InvalidInputError, ValueError)
