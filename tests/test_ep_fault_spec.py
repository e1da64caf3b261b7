"""Fault-injection specs (ELASTICEP_FAULT / WorkerConfig.fault): parsing and firing."""

from __future__ import annotations

import pytest

from elasticep.config import DeploymentConfig, WorkerConfig
from elasticep.elastic.fault_injection import FaultInjector, FaultSpec, parse_faults


def test_parse_specs():
    assert parse_faults("kill:rank=2:step=10") == [FaultSpec(2, 10)]
    assert parse_faults("kill:rank=0:step=3:layer=1, kill:rank=1:step=5") == [
        FaultSpec(0, 3, 1), FaultSpec(1, 5)]
    assert parse_faults(None) == [] and parse_faults("") == []
    assert parse_faults("kill:rank=3:admit=1") == [FaultSpec(3, None, None, 1)]
    assert parse_faults("kill:rank=1:loading") == [FaultSpec(1, None, loading=True)]


@pytest.mark.parametrize("bad", ["stop:rank=1:step=2", "kill:rank=1", "kill:rank=x:step=1",
                                 "kill:rank=1:step=2:when=3", "kill:rank1:step=2",
                                 "kill:rank=1:step=2:admit=1", "kill:rank=1:layer=2:admit=1",
                                 "kill:rank=1:loading:step=2", "kill:rank=1:load",
                                 "kill:loading"])
def test_bad_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_faults(bad)


def test_injector_fires_only_its_rank_step_and_layer(monkeypatch):
    fired = []
    monkeypatch.setenv("ELASTICEP_FAULT", "kill:rank=2:step=4:layer=3")
    inj = FaultInjector.from_config(2, "kill:rank=2:step=7,kill:rank=1:step=1")
    monkeypatch.setattr(inj, "_die", fired.append)
    assert inj.specs == [FaultSpec(2, 7), FaultSpec(2, 4, 3)]
    for step in range(9):
        inj.at_step(step)
        for layer in range(6):
            inj.at_layer(layer)
    assert fired == ["step 4 layer 3", "step 7"]


def test_injector_fires_at_its_admission(monkeypatch):
    fired = []
    inj = FaultInjector.from_config(3, "kill:rank=3:admit=2")
    monkeypatch.setattr(inj, "_die", fired.append)
    for step in range(4):
        inj.at_step(step)
    inj.at_admit()
    assert fired == []
    inj.at_admit()
    assert fired == ["admission 2"]


def test_injector_fires_while_loading_only_for_its_rank(monkeypatch):
    fired = []
    for rank in (1, 2):
        inj = FaultInjector.from_config(rank, "kill:rank=2:loading")
        monkeypatch.setattr(inj, "_die", fired.append)
        inj.at_loading()
        inj.at_step(0)
        inj.at_admit()
        fired.append(rank)
    assert fired == [1, "loading", 2]


def test_worker_config_round_trip():
    cfg = WorkerConfig(DeploymentConfig(model="m", ep_size=4, max_ep_size=6), 3, "127.0.0.1:1",
                       join_mode="recover", fault="kill:rank=3:step=1")
    assert WorkerConfig.from_json(cfg.to_json()) == cfg


def test_injector_fires_at_the_start_of_its_admission(monkeypatch):
    assert parse_faults("kill:rank=3:admit_start=2") == [FaultSpec(3, None, admit_start=2)]
    with pytest.raises(ValueError):
        parse_faults("kill:rank=3:admit_start=1:admit=1")
    fired = []
    inj = FaultInjector.from_config(3, "kill:rank=3:admit_start=2")
    monkeypatch.setattr(inj, "_die", fired.append)
    inj.at_admit_start()
    inj.at_admit()
    assert fired == []
    inj.at_admit_start()
    assert fired == ["the start of admission 2"]
