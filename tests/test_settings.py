"""Settings by concern: groups in code, one public (flat) name per setting everywhere else."""

from __future__ import annotations

import json

import pytest

from tasks.errors import SettingsError
from tasks.settings import FLAT_NAMES, GROUPS, Settings, known_names, load_settings, setting_default


def test_settings_are_grouped_by_concern():
    assert len(Settings.model_fields) <= 20
    every_field = {(group, field) for group, model in GROUPS.items() for field in model.model_fields}
    assert set(FLAT_NAMES.values()) == every_field          # each grouped setting has one public name
    assert len(set(FLAT_NAMES.values())) == len(FLAT_NAMES)


def test_the_names_users_already_set_keep_working(tmp_path):
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps({"profile_repeats": 5, "engine": {"check": False}}))
    settings = load_settings({"SPECDEC_PROFILE_MAX_AGE_DAYS": "2.5", "SPECDEC_EVAL_K_MAX": "4",
                              "SPECDEC_CPU_QUEUE": "db", "SPECDEC_PROFILE_BATCH_SIZES": "[1, 2]",
                              "SPECDEC_SETTINGS_FILE": str(settings_file)},
                             confirm_tolerance=0.5)
    assert settings.profile.max_age_days == 2.5 and settings.profile.batch_sizes == (1, 2)
    assert settings.plan.k_max == 4 and settings.quality.k_max == 16     # two K limits, two groups
    assert settings.queues.cpu == "db" and settings.live.tolerance == 0.5
    assert settings.profile.repeats == 5 and settings.engine.check is False
    assert settings.value("eval_k_max") == 4


def test_overrides_round_trip_by_public_name():
    settings = load_settings({}, eval_k_max=3, candidates=("suffix",), engine_check=False, min_per_domain=2)
    overrides = settings.overrides()
    assert overrides == {"eval_k_max": 3, "candidates": ["suffix"], "engine_check": False,
                         "min_per_domain": 2}
    assert json.loads(json.dumps(overrides)) == overrides           # fit for XCom and RunSpec
    assert load_settings({}, **overrides) == settings
    assert load_settings({}).overrides() == {}


def test_defaults_have_one_source():
    assert setting_default("eval_k_max") == Settings().plan.k_max == 8
    assert setting_default("candidates") == list(Settings().plan.candidates)
    assert all(setting_default(name) is not None or Settings().value(name) is None for name in known_names())


def test_an_unknown_or_invalid_setting_is_named():
    with pytest.raises(SettingsError, match="unknown setting 'profile_repeat'"):
        load_settings({}, profile_repeat=2)
    with pytest.raises(SettingsError, match="min_per_domain 9 > max_per_domain 3"):
        load_settings({"SPECDEC_MIN_PER_DOMAIN": "9", "SPECDEC_MAX_PER_DOMAIN": "3"})
    with pytest.raises(SettingsError, match="group 'profile' must be an object"):
        load_settings({}, profile=3)
