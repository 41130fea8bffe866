"""The dev stack's replica option (podbay.devstack.stack): how many processes of each service, their names,
ports and logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from podbay.devstack.stack import SERVICES, Stack, StackError, StackPorts, replica_counts


def test_counts_from_env_default_one_and_bounds() -> None:
    assert replica_counts({}) == {"api": 1, "scheduler": 1, "warmpool": 1}
    env = {"PODBAY_API_REPLICAS": "2", "PODBAY_SCHEDULER_REPLICAS": "3"}
    assert replica_counts(env) == {"api": 2, "scheduler": 3, "warmpool": 1}
    assert replica_counts(env, {"scheduler": 1}) == {"api": 2, "scheduler": 1, "warmpool": 1}
    for bad in ("0", "17", "two"):
        with pytest.raises(StackError, match="PODBAY_WARMPOOL_REPLICAS must be an integer"):
            replica_counts({"PODBAY_WARMPOOL_REPLICAS": bad})
    with pytest.raises(StackError, match="runs once per host"):
        replica_counts({}, {"nodeagent": 2})


def test_further_replicas_get_their_own_name_port_and_log(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    for spec in SERVICES:
        (bins / spec.script).write_text("#!/bin/sh\n")
    stack = Stack(data_dir=tmp_path, log_dir=tmp_path / "logs", cache_dir=tmp_path, ports=StackPorts.free(),
                  bin_dir=bins, base_env={"PODBAY_API_REPLICAS": "2", "PODBAY_GATEWAY_BIN": str(bins / "podbay-gateway")},
                  replicas={"scheduler": 2})
    names = stack.service_names()
    assert names[:4] == ["api", "api-2", "scheduler", "scheduler-2"] and names.count("warmpool") == 1
    stack.env = {"PODBAY_API_PORT": str(stack.ports.api), "PODBAY_X": "shared"}
    api_spec = next(s for s in SERVICES if s.name == "api")
    first, second = stack._service(api_spec, 1), stack._service(api_spec, 2)  # noqa: SLF001
    assert (first.name, first.port) == ("api", stack.ports.api)
    assert second.name == "api-2" and second.port != stack.ports.api
    assert second.env["PODBAY_API_PORT"] == str(second.port) and second.env["PODBAY_X"] == "shared"
    assert first.env["PODBAY_API_PORT"] == str(stack.ports.api)
    assert second.log_path == tmp_path / "logs" / "api-2.log"
    stack.services = {"api": first, "api-2": second}
    assert stack.api_urls == [stack.api_url, second.url]


def test_only_replicable_services_can_be_added(tmp_path: Path) -> None:
    stack = Stack(data_dir=tmp_path, log_dir=tmp_path / "logs", cache_dir=tmp_path, ports=StackPorts.free())
    with pytest.raises(StackError, match="runs once per host"):
        stack.add_replica("nodeagent")
