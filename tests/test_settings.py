"""Settings by concern: groups in code, one name per setting (`<group>_<field>`) everywhere else."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from tasks.errors import SettingsError
from tasks.settings import (DEPRECATED_ALIASES, GROUPS, NAMES, Settings, known_names, load_settings,
                            setting_default)


def test_settings_are_grouped_by_concern():
    assert len(Settings.model_fields) <= 20
    every_field = {(group, field) for group, model in GROUPS.items() for field in model.model_fields}
    assert set(NAMES.values()) == every_field               # each grouped setting has a name ...
    assert len(set(NAMES.values())) == len(NAMES)           # ... exactly one ...
    assert all(name == f"{group}_{field}" for name, (group, field) in NAMES.items())  # ... derived
    assert len(known_names()) == len(set(known_names()))


def test_each_deprecated_alias_names_an_existing_setting():
    assert set(DEPRECATED_ALIASES.values()) <= set(NAMES)
    assert not set(DEPRECATED_ALIASES) & set(known_names())            # an old name is never current
    assert all(name in NAMES or name in DEPRECATED_ALIASES for name in (      # the old public names
        "import_batch_size", "sample_window_days", "min_per_domain", "k_max", "candidates", "eval_k_max",
        "plan_engine", "profile_max_age_days", "confirm_requests", "live_veto", "validation_rows",
        "greedy_check_tokens", "serving_python", "engine_check", "serving_image", "monitor_window_s",
        "load_check", "load_check_levels", "load_check_more_requests", "gpu_queue", "cpu_queue",
        "promotion_regression_tolerance"))
    assert DEPRECATED_ALIASES["eval_k_max"] == "plan_k_max" and DEPRECATED_ALIASES["k_max"] == "quality_k_max"
    assert DEPRECATED_ALIASES["gpu_queue"] == "queues_gpu"
    assert DEPRECATED_ALIASES["load_check_levels"] == "load_levels" and "load_check" not in DEPRECATED_ALIASES


def test_one_name_everywhere(tmp_path):
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"profile_repeats": 5, "engine": {"check": False}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # no deprecated name in use
        settings = load_settings({"SPECDEC_PROFILE_MAX_AGE_DAYS": "2.5", "SPECDEC_PLAN_K_MAX": "4",
                                  "SPECDEC_QUEUES_CPU": "db", "SPECDEC_PROFILE_BATCH_SIZES": "[1, 2]",
                                  "SPECDEC_SETTINGS_FILE": str(settings_file)},
                                 live_tolerance=0.5)
        assert settings.value("plan_k_max") == 4
    assert settings.profile.max_age_days == 2.5 and settings.profile.batch_sizes == (1, 2)
    assert settings.plan.k_max == 4 and settings.quality.k_max == 16     # two K limits, two groups
    assert settings.queues.cpu == "db" and settings.live.tolerance == 0.5
    assert settings.profile.repeats == 5 and settings.engine.check is False


def test_the_names_users_already_set_keep_working_and_warn(tmp_path):
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"min_per_domain": 3}))
    with pytest.warns(DeprecationWarning) as caught:
        settings = load_settings({"SPECDEC_EVAL_K_MAX": "4", "SPECDEC_CPU_QUEUE": "db",
                                  "SPECDEC_SETTINGS_FILE": str(settings_file)},
                                 confirm_tolerance=0.5)
    messages = [str(warning.message) for warning in caught]
    assert messages == [f"{settings_file}: key 'min_per_domain' is deprecated: use 'sample_min_per_domain'",
                        "SPECDEC_EVAL_K_MAX is deprecated: use SPECDEC_PLAN_K_MAX",
                        "SPECDEC_CPU_QUEUE is deprecated: use SPECDEC_QUEUES_CPU",
                        "setting 'confirm_tolerance' is deprecated: use 'live_tolerance'"]   # one each
    assert all(warning.filename == __file__ for warning in caught)   # blames the caller
    assert settings.plan.k_max == 4 and settings.queues.cpu == "db"
    assert settings.sample.min_per_domain == 3 and settings.live.tolerance == 0.5
    with pytest.warns(DeprecationWarning, match="setting 'eval_k_max' is deprecated: use 'plan_k_max'"):
        assert settings.value("eval_k_max") == 4
    assert settings.overrides() == {"plan_k_max": 4, "queues_cpu": "db", "sample_min_per_domain": 3,
                                    "live_tolerance": 0.5}           # new names only


def test_the_new_name_wins_over_the_old_one_in_the_same_place(tmp_path):
    with pytest.warns(DeprecationWarning, match="SPECDEC_EVAL_K_MAX is deprecated: use SPECDEC_PLAN_K_MAX"):
        settings = load_settings({"SPECDEC_EVAL_K_MAX": "4", "SPECDEC_PLAN_K_MAX": "5"})
    assert settings.plan.k_max == 5
    with pytest.warns(DeprecationWarning, match="'gpu_queue' is deprecated: use 'queues_gpu'"):
        assert load_settings({}, gpu_queue="old", queues_gpu="new").queues.gpu == "new"
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"queues_gpu": "new", "gpu_queue": "old"}))
    with pytest.warns(DeprecationWarning, match="key 'gpu_queue' is deprecated"):
        assert load_settings({"SPECDEC_SETTINGS_FILE": str(settings_file)}).queues.gpu == "new"
    # between places the precedence holds: an old variable still wins over the settings file
    settings_file.write_text(json.dumps({"queues_gpu": "file"}))
    with pytest.warns(DeprecationWarning, match="SPECDEC_GPU_QUEUE"):
        assert load_settings({"SPECDEC_SETTINGS_FILE": str(settings_file),
                              "SPECDEC_GPU_QUEUE": "env"}).queues.gpu == "env"


def test_overrides_round_trip_by_name():
    settings = load_settings({}, plan_k_max=3, plan_candidates=("suffix",), engine_check=False,
                             sample_min_per_domain=2)
    overrides = settings.overrides()
    assert overrides == {"plan_k_max": 3, "plan_candidates": ["suffix"], "engine_check": False,
                         "sample_min_per_domain": 2}
    assert json.loads(json.dumps(overrides)) == overrides           # fit for XCom and RunSpec
    assert load_settings({}, **overrides) == settings
    assert load_settings({}).overrides() == {}


def test_defaults_have_one_source():
    assert setting_default("plan_k_max") == Settings().plan.k_max == 8
    assert setting_default("plan_candidates") == list(Settings().plan.candidates)
    assert all(setting_default(name) is not None or Settings().value(name) is None for name in known_names())


def test_an_unknown_or_invalid_setting_is_named():
    with pytest.raises(SettingsError, match="unknown setting 'profile_repeat'"):
        load_settings({}, profile_repeat=2)
    with pytest.raises(SettingsError, match="unknown setting 'plan_kmax'"):
        Settings().value("plan_kmax")
    with pytest.raises(SettingsError, match="min_per_domain 9 > max_per_domain 3"):
        load_settings({"SPECDEC_SAMPLE_MIN_PER_DOMAIN": "9", "SPECDEC_SAMPLE_MAX_PER_DOMAIN": "3"})
    with pytest.raises(SettingsError, match=r"SPECDEC_QUEUES_GPU \(queues_gpu\)"):
        load_settings({"SPECDEC_QUEUES_GPU": ""})
    with pytest.raises(SettingsError, match="group 'profile' must be an object"):
        load_settings({}, profile=3)


def test_the_settings_reference_lists_every_deprecated_alias():
    reference = (Path(__file__).parent.parent / "docs" / "operations.md").read_text("utf-8")
    assert dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|$", reference, re.M)) == DEPRECATED_ALIASES
