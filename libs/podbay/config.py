"""Configuration for every podbay process, read from ``PODBAY_*`` environment variables and a TOML file.

One settings model serves all processes so that a variable means the same thing everywhere; each
process reads the fields it needs. Every field is documented in README.md ("Configuration") and
docs/operations.md. Units are in the field names (``_ms``, ``_s``, ``_mib``, ``_gib``).

Sources, strongest first: environment variables (``PODBAY_X_Y`` for field ``x_y``), then the TOML file named by
``PODBAY_CONFIG_FILE`` (top-level keys are the field names: ``nats_url = "nats://..."``), then the defaults. A
file that is missing, unreadable, not TOML, names an unknown key or holds a bad value raises
:class:`ConfigError` with one line that says which and where; services print it and exit with status 2.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from podbay.egress_ranges import parse_cidrs
from podbay.errors import PodbayError

__all__ = ["Settings", "get_settings", "default_data_dir", "default_cache_dir", "ConfigError", "CONFIG_FILE_ENV",
           "load_settings", "DEFAULT_TCG_TB_SIZE_MIB"]

CONFIG_FILE_ENV = "PODBAY_CONFIG_FILE"

#: The translation buffer of a TCG guest, in MiB (``Settings.tcg_tb_size_mib``; measured in docs/SPECIFICATION.md).
DEFAULT_TCG_TB_SIZE_MIB = 64


class ConfigError(PodbayError):
    """The configuration (file or environment) cannot be used; the message says which key and where."""

    code = "invalid_config"
    http_status = 500


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/podbay`` (``~/.local/share/podbay``): node stores, server data, the dev config."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "podbay"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/podbay`` (``~/.cache/podbay``): template images and kernels, keyed by their inputs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "podbay"


class Settings(BaseSettings):
    """All ``PODBAY_*`` settings. Field ``x_y`` is read from ``PODBAY_X_Y``."""

    model_config = SettingsConfigDict(env_prefix="PODBAY_", extra="ignore")

    # places
    data_dir: Path = Field(default_factory=default_data_dir, description="Root of all server and node state.")
    log_dir: Path | None = Field(None, description="Service logs; default DATA_DIR/logs.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Build cache (templates, kernels).")

    # servers
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server with JetStream; for a cluster, several "
                          "servers' URLs separated by commas (clients connect to any and move to another when "
                          "theirs is lost).")
    nats_replicas: int = Field(0, ge=0, le=5, description="JetStream replicas of podbay's streams and KV buckets; "
                               "0: 3 when the cluster has at least three servers (listed in PODBAY_NATS_URL or "
                               "announced by the server), else 1.")
    pg_dsn: str = Field("postgresql://podbay@127.0.0.1:5432/podbay", description="PostgreSQL DSN.")
    s3_url: str = Field("http://127.0.0.1:8333", description="S3 endpoint.")
    s3_bucket: str = Field("podbay", description="Bucket for snapshots.")
    s3_region: str = Field("us-east-1")

    # ports of the servers `podbay up` starts itself
    nats_port: int = Field(4222, description="NATS port for the dev stack.")
    nats_servers: int = Field(1, ge=1, le=5, description="NATS servers the dev stack starts: 1, or a JetStream "
                              "cluster of 3 (the first on PODBAY_NATS_PORT, the others and the routes on free "
                              "ports).")
    pg_port: int = Field(5432, description="PostgreSQL port for the dev stack.")
    s3_port: int = Field(8333, description="S3 (SeaweedFS) port for the dev stack.")
    bin_dir: Path | None = Field(None, description="Where the podbay-* entry points live; default beside python.")
    nodes: int = Field(1, ge=1, le=64, description="`podbay up`: how many nodes to run on this host. Above 1, each "
                       "node (node-a, node-b, ...) gets its own network namespace, node agent, snapshotter and "
                       "gateway, and the servers listen on the namespaces' host bridge (needs root).")

    # api
    api_host: str = Field("127.0.0.1")
    api_port: int = Field(8080)
    api_h2_port: int | None = Field(None, ge=1, le=65535, description="Also serve the API, port edge included, on "
                                    "this port with Hypercorn: HTTP/2 in cleartext (h2c, by prior knowledge or "
                                    "Upgrade) besides HTTP/1.1 and WebSocket, for clients and TLS terminators "
                                    "that speak HTTP/2. Unset: only PODBAY_API_PORT (uvicorn, HTTP/1.1). "
                                    "`podbay up` sets it (default 8081).")
    api_tls_port: int | None = Field(None, ge=1, le=65535, description="Also serve the API, port edge included, "
                                     "over HTTPS on this port, for E2B's https://{port}-{sandboxID}.{domain} "
                                     "addresses (`Sandbox.get_host`). Needs PODBAY_API_TLS_CERT_FILE and "
                                     "PODBAY_API_TLS_KEY_FILE (an operator's wildcard certificate), or "
                                     "PODBAY_API_TLS_CA_CERT_FILE and PODBAY_API_TLS_CA_KEY_FILE (a CA the edge "
                                     "mints a certificate per name from). Clients reach it on 443 unless "
                                     "PODBAY_E2B_DOMAIN carries this port. `podbay up` sets it (default 8443).")
    api_tls_cert_file: Path | None = Field(None, description="PEM certificate chain the TLS edge serves for "
                                           "every name: a wildcard for *.PODBAY_E2B_DOMAIN (and "
                                           "*.PODBAY_PORTS_DOMAIN). Sandbox ids hold '_', which OpenSSL-based "
                                           "clients never match against a wildcard: see docs/operations.md.")
    api_tls_key_file: Path | None = Field(None, description="PEM private key of PODBAY_API_TLS_CERT_FILE.")
    api_tls_ca_cert_file: Path | None = Field(None, description="PEM CA certificate from which the TLS edge mints "
                                              "a certificate per server name under the E2B and ports domains "
                                              "(when no PODBAY_API_TLS_CERT_FILE is set). `podbay up` makes one: "
                                              "DATA_DIR/edge-ca.pem.")
    api_tls_ca_key_file: Path | None = Field(None, description="PEM private key of PODBAY_API_TLS_CA_CERT_FILE.")
    api_url: str | None = Field(None, description="Client side: where the API answers.")
    api_key: str | None = Field(None, description="Client side: bearer API key.")
    create_timeout_s: float = Field(60.0, description="Upper bound a waiting create/delete call blocks.")
    api_body_max_mib: int = Field(32, ge=1, description="Largest request body the API reads into memory, MiB "
                                  "(JSON and form bodies: an exec takes up to 16 MiB of stdin and 2 MiB of arguments); larger ones are "
                                  "refused with 413 body_too_large "
                                  "before they are read. File uploads, build contexts and envd traffic stream "
                                  "and have limits of their own.")
    idempotency_key_ttl_s: float = Field(86400.0, gt=0, description="How long an `Idempotency-Key` of a "
                                         "create is remembered (seconds): a retry within it returns the "
                                         "sandbox the key made; after it the key is free again and the "
                                         "API's sweep deletes it.")
    exec_timeout_s: float = Field(300.0, description="Default exec timeout when the request gives none.")
    internal_token: str = Field("", description="Shared secret between the API and node data planes.")
    grant_signing_key: str = Field("", description="API only: base64 of the raw 32-byte Ed25519 private key "
                                   "that signs node grants (podbay.grants), one per node call: tenant, "
                                   "sandbox, generation, kind of operation, 60 s expiry. The API refuses to "
                                   "start without it. `podbay up` keeps one in DATA_DIR/grant.key.")
    grant_verify_key: str = Field("", description="Node agents: base64 of the raw 32-byte Ed25519 public key "
                                  "of PODBAY_GRANT_SIGNING_KEY; the data plane refuses (403 `grant_refused`) "
                                  "every /internal call without a valid grant. The node agent refuses to "
                                  "start without it.")
    webhook_max_attempts: int = Field(6, ge=1, le=20, description="POSTs per webhook and event before giving up.")
    webhook_backoff_s: float = Field(1.0, gt=0, description="First wait between webhook attempts; doubles each time.")
    webhook_backoff_max_s: float = Field(60.0, gt=0, description="Longest wait between webhook attempts.")
    webhook_timeout_s: float = Field(10.0, gt=0, description="Bound on one webhook POST.")
    webhooks_enabled: bool = Field(True, description="Run the webhook deliverer in this API process.")
    webhook_allow_private: bool = Field(False, description="Let webhooks reach loopback, link-local (cloud "
                                        "metadata such as 169.254.169.254), private and other non-public "
                                        "addresses. Off: `POST /v1/webhooks` refuses an IP literal that is not "
                                        "globally routable or `localhost` (422 `validation_error`), and every "
                                        "delivery resolves the host first and refuses such an address. Only "
                                        "for single-tenant set-ups; `podbay up` turns it on unless the "
                                        "environment or the config file sets it.")
    e2b_domain: str | None = Field(None, description="Wildcard domain routed to the API: E2B SDK traffic for "
                                   "{port}-{sandboxID}.DOMAIN goes to that sandbox's envd API, and other ports to "
                                   "the port edge; returned to E2B's SDK as the sandbox's `domain`. It may carry "
                                   "a port (`e2b.localhost:8443`) when the TLS edge is not on 443. `podbay up` "
                                   "sets `e2b.localhost:<PODBAY_API_TLS_PORT>`.")
    # ports (services/api/routes/ports*.py): guest ports reached through the API's edge
    ports_domain: str = Field("localhost", description="Guest ports answer at {port}-{sandbox}.DOMAIN on the API "
                              "(the sandbox id spelled with '-' for '_'); `localhost` resolves to loopback with "
                              "no DNS set-up. The path form /ports/{port}-{sandbox}/ needs no wildcard DNS.")
    ports_public_rate_per_s: float = Field(50.0, gt=0, description="Requests per second one public port takes, "
                                           "counted across all API replicas in PostgreSQL (per second of its "
                                           "clock; below 1, one request per 1/rate seconds); further ones get "
                                           "429.")
    ports_wake: bool = Field(True, description="A request to a paused or suspended sandbox's port resumes it "
                             "(bounded by the resume timeouts); off: it answers 409 `invalid_state`.")
    # schedules (services/api/schedules/): run by the API process that holds the `schedules` lease
    schedules_enabled: bool = Field(True, description="Run the schedule firer in this API process (one replica "
                                    "fires at a time, behind the `schedules` leader lease).")
    schedule_tick_s: float = Field(1.0, gt=0, le=60, description="How often the schedule firer looks for due "
                                   "schedules and runs, seconds.")
    schedule_jitter_s: float = Field(5.0, ge=0, le=3600, description="Each fire starts up to this long after its "
                                     "time (a fixed spread per schedule and time), so schedules of the same "
                                     "minute do not all wake at once; 0 = on time.")
    schedule_node_wakes_max: int = Field(4, ge=1, le=1024, description="Schedule runs waking or running at "
                                         "once per node (suspended sandboxes count against one shared pool "
                                         "until placed); further runs wait their turn.")
    schedules_per_sandbox_max: int = Field(20, ge=1, le=10000, description="Schedules one sandbox may have.")
    schedule_missed_grace_s: float = Field(60.0, ge=0, description="A fire found this long after its time "
                                           "(the firer was down) is missed: its schedule's `missed` policy "
                                           "runs it once or skips it.")

    # node agent
    node_id: str = Field("node-1", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    node_host: str = Field("127.0.0.1", description="Address the node's data plane listens on.")
    node_port: int = Field(8090, description="Data plane port.")
    node_memory_mib: int = Field(0, description="Memory offered to sandboxes, MiB. Set: what the node's sandboxes "
                                 "may use as measured (and the nominal figure MEMORY_OVERCOMMIT_RATIO multiplies). "
                                 "0: 80% of host RAM as the nominal figure, and measured use limited only by the "
                                 "host's memory less MEMORY_HEADROOM_MIB.")
    node_vcpus: int = Field(0, description="vCPUs offered to running sandboxes; 0 means 128x host cores (an idle "
                            "guest uses about 0.5% of a core; paused ones none).")
    node_store_size_gib: int = Field(40, description="Size of the loop-backed btrfs file when DATA_DIR is not btrfs.")
    volume_max_size_gib: int = Field(64, ge=1, description="Largest volume a tenant may create, GiB (a sparse "
                                     "ext4 file on the node's btrfs store: it costs what is written).")
    node_heartbeat_s: float = Field(2.0)
    node_heartbeat_ttl_s: float = Field(10.0)
    node_lost_grace_s: float = Field(60.0, ge=0, description="Scheduler: a ready or draining node whose heartbeat "
                                     "key expired (HEARTBEAT_TTL_S) and stays absent this much longer is marked "
                                     "lost; its sandboxes are fenced and restored elsewhere from their newest "
                                     "promoted full snapshot.")
    node_loss_check_s: float = Field(1.0, gt=0, description="Scheduler: how often heartbeats are checked for "
                                     "lost nodes.")
    node_fence_check_s: float = Field(5.0, gt=0, description="Node agent: how often it checks that each VM it "
                                      "runs is still its own (node and generation) and stops those that are not.")
    accel: Literal["auto", "kvm", "tcg"] = Field("auto", description="VMM acceleration.")
    kvm_probe_timeout_s: float = Field(8.0)
    boot_timeout_s: float = Field(90.0, description="Node agent: how long a guest booted from its disk (a template "
                                  "build) has to answer on its channel.")
    restore_timeout_s: float = Field(30.0, description="Node agent: bound on one restore attempt, and how long a "
                                     "restored, resumed or reattached guest has to answer on its channel.")
    restore_retries: int = Field(2, description="Node agent: restore attempts after the first that failed.")
    restore_concurrency: int = Field(0, ge=0, description="Restores (and boots) a node runs at a time until the "
                                     "guest answers; 0 means one per host core.")
    qemu_binary: str = Field("qemu-system-x86_64")
    tcg_tb_size_mib: int = Field(DEFAULT_TCG_TB_SIZE_MIB, ge=0, le=2048, description="Under TCG, the size of "
                                 "each QEMU's translation buffer (`-accel tcg,tb-size=`), in MiB: the host memory "
                                 "a busy guest's translated code can hold (QEMU 7.2's own default, 1 GiB, becomes "
                                 "resident as a guest runs). 0 = QEMU's default. KVM guests have none.")
    guest_aslr: Literal["auto", "on", "off"] = Field("auto", description="Address space layout randomisation "
                                                     "of the processes inside guests (the guest kernel's "
                                                     "`kernel.randomize_va_space`), set in each template before "
                                                     "its snapshot: `auto` keeps it on under KVM and turns it off "
                                                     "under TCG, where QEMU 7.2 ties translated code to virtual "
                                                     "addresses and every exec would translate the loader and "
                                                     "libc anew. Part of the template's key.")
    vmm_confine: bool = Field(True, description="Run each QEMU inside bubblewrap as VMM_USER with no capabilities "
                              "(docs/DESIGN.md §6); false runs it unconfined as the node agent's user (debugging only).")
    vmm_user: str = Field("podbay-vm", description="Unprivileged system user confined QEMUs run as; created at "
                          "start when missing.")
    vmm_uid_range: str = Field("", description="Uids (A-B, A >= 1000) confined QEMUs run as, one of its own "
                               "each (gid the same), instead of all as VMM_USER: no two guests' QEMUs share an "
                               "owner. Recorded in /run/podbay/vmm-uids; empty: one shared user.")
    vmm_seccomp: bool = Field(True, description="Start each QEMU with its own seccomp filter (`-sandbox on,"
                              "obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny`): no "
                              "exec, fork, setuid, scheduler or obsolete system calls, even if a guest takes "
                              "over QEMU's device emulation.")
    console_log_max_kib: int = Field(1024, ge=16, description="A guest's serial console log (console.log in its "
                                     "VM directory) is rotated at this size, KiB; one older file "
                                     "(console.log.1) is kept.")
    console_log_rate_kib_s: int = Field(64, ge=1, description="Console bytes per second a guest may log (a "
                                        "burst of CONSOLE_LOG_MAX_KIB is allowed); beyond it they are dropped "
                                        "and counted.")
    channel_max_bad_frames: int = Field(8, ge=1, description="Bad frames in a row (torn, oversized, or a run of "
                                        "garbage) after which the node drops a guest's channel; the sandbox's "
                                        "calls then fail with `guest_channel_broken`.")
    vmm_cgroups: bool = Field(True, description="Put each QEMU in a cgroup v2 of its own under "
                              "`podbay.slice` (CGROUP_ROOT) with CPU, memory, pids (and IO where "
                              "VMM_IO_MAX is set) limits from the sandbox's size; where cgroup v2 or a "
                              "controller is missing that limit is skipped (logged once).")
    cgroup_root: Path = Field(Path("/sys/fs/cgroup"), description="The cgroup v2 mount (a hybrid host's is often "
                              "/sys/fs/cgroup/unified); used when it has a cgroup.controllers file.")
    vmm_cpu_headroom_percent: int = Field(50, ge=0, le=1000, description="cpu.max of a QEMU: its vCPUs x 100 "
                                          "% of a core plus this much for QEMU's own threads (I/O, "
                                          "migration), per sandbox.")
    vmm_memory_overhead_mib: int = Field(256, ge=64, description="memory.max of a QEMU: guest RAM + TCG's "
                                         "translation buffer + this (QEMU's heap and page tables; measured in "
                                         "services/nodeagent/vm/cgroups.py). Guest RAM is a shared file mapping, so "
                                         "at the limit the kernel writes RAM pages back to their file rather "
                                         "than killing.")
    vmm_pids_max: int = Field(128, ge=16, description="pids.max of a QEMU's cgroup (its threads: vCPUs, I/O "
                              "workers, RCU, migration).")
    vmm_io_max: str = Field("", description="io.max of a QEMU's cgroup, applied to the block device holding "
                            "DATA_DIR (e.g. `rbps=209715200 wbps=104857600 riops=20000 wiops=10000`); empty: "
                            "only io.weight.")
    sandbox_net_rate_mbit: int = Field(1000, ge=0, description="Each sandbox's network rate, Mbit/s in each "
                                       "direction (tc on its tap: tbf towards the guest, a policer on what it "
                                       "sends); 0 = unlimited.")
    tap_check_s: float = Field(2.0, ge=0, description="How often the node agent checks that each VM's tap still "
                               "exists; a vanished one is repaired by moving the guest to a new VM on a new tap "
                               "(processes carry on); 0 = never.")
    paused_release_s: float = Field(60.0, description="A sandbox paused this long has its RAM written back to its "
                                    "file and released (QEMU exits; resume restores it); 0 = never.")
    lease_s: int = Field(3600, ge=10, description="Default sandbox lease; renewed by every call on the sandbox.")
    lease_action: Literal["pause", "delete"] = Field("pause", description="What happens when a lease runs out.")
    idle_cpu_percent: float = Field(2.0, description="A guest using more CPU than this (% of a core) is busy.")
    snapshot_disk_interval_s: float = Field(60.0, description="Disk snapshot cadence: one is taken this often if "
                                            "the disk changed since the last snapshot (btrfs extents, exact); 0 = off.")
    snapshot_full_interval_s: float = Field(900.0, description="Full snapshot cadence: one is taken this often if the "
                                            "disk or the guest's RAM changed since the last full snapshot; 0 = off.")
    cadence_cpu_budget: float = Field(0.1, ge=0.0, le=1.0, description="Share of one core a node's snapshot and "
                                      "promotion cadence may use on average, half each for the node agent's "
                                      "snapshots and the snapshotter's promotions (work of w seconds is followed "
                                      "by w / share - w seconds of none); snapshots also wait, up to 30 s, while "
                                      "API calls are in flight. 0 = unpaced.")
    node_cpu_pressure_max: float = Field(90.0, ge=0.0, le=100.0, description="Admission: a node whose CPU pressure "
                                         "(/proc/pressure/cpu some avg10 and avg60, percent, both) is above this "
                                         "takes no new sandboxes (placement chooses another node, or refuses with "
                                         "no_capacity); 0 = CPU pressure is not considered.")
    retain_disk_snapshots: int = Field(10, ge=1, description="Disk snapshots kept per sandbox (K).")
    retain_full_snapshots: int = Field(3, ge=1, description="Full snapshots kept per sandbox (M).")
    # promotion to object storage, suspend and resume (snapshotter, node agent)
    chunk_size_kib: int = Field(256, ge=64, le=65536, description="Content-addressed chunk size of promoted "
                                "snapshot files; changing it stops dedup against chunks already stored.")
    s3_concurrency: int = Field(8, ge=1, le=64, description="Object requests in flight per process.")
    s3_bandwidth_mib_s: float = Field(0.0, ge=0, description="Upload and download bandwidth cap per process "
                                      "(MiB/s of bytes on the wire); 0 = unlimited.")
    s3_multipart_threshold_mib: int = Field(8, ge=5, description="Objects larger than this go up as multipart "
                                            "uploads of this part size.")
    compression_level: int = Field(3, ge=1, le=19, description="zstd level of uploaded chunks.")
    promote_disk_interval_s: float = Field(300.0, ge=0, description="The newest disk snapshot of each sandbox "
                                           "is promoted this often (a lost node loses at most this much "
                                           "disk work); 0 = off.")
    volume_promote_interval_s: float = Field(300.0, ge=0, description="Snapshotter: a volume whose file changed "
                                             "since its newest promoted snapshot is snapshotted (a reflink) and "
                                             "promoted this often, so a lost node loses at most this much of a "
                                             "volume's writes (plus what a guest's page cache had not written back, "
                                             "about 30 s by Linux defaults); a suspend promotes its volumes too; "
                                             "0 = only on suspend.")
    retain_volume_snapshots: int = Field(3, ge=1, description="Promoted snapshots kept per volume (older ones "
                                         "are dropped and their chunks collected).")
    gc_interval_s: float = Field(600.0, gt=0, description="Snapshotter garbage-collection cycle.")
    gc_grace_s: float = Field(3600.0, ge=0, description="A chunk unreferenced for this long is deleted.")
    suspend_timeout_s: float = Field(900.0, gt=0, description="Bound on a suspend's promotion.")
    fault_step: str = Field("", description="Testing only: SIGKILL this process when it reaches the named step "
                            "(e.g. promote.uploaded, suspend.promoted, resume.fetched); empty = never.")
    warm_claim_timeout_s: float = Field(5.0, gt=0, description="How long a create waits for a node to hand over a "
                                        "claimed warm slot before it falls back to a restore.")
    warm_prepare_nice: int = Field(19, ge=0, le=19, description="Warm pools: nice value of a slot's QEMU from "
                                   "its start (restore, hygiene, first exec) until it waits, so refills take only "
                                   "the CPU that claims, creates and running sandboxes leave; back to 0 once the "
                                   "slot waits.")
    warm_refill_delay_s: float = Field(1.0, ge=0, le=30, description="Warm pools: after a claim, the refill "
                                       "starts no restore for this long, so the new sandbox's first command does "
                                       "not share the node with one (0: at once).")
    warm_interval_s: float = Field(2.0, gt=0, description="Warm pools: how often targets are recomputed and "
                                   "slots checked (refills also start at once after a claim).")
    warm_demand_window_s: float = Field(60.0, gt=0, description="Warm pools: creates counted as recent demand.")
    warm_demand_horizon_s: float = Field(10.0, gt=0, description="Warm pools: keep enough slots for this many "
                                         "seconds of recent demand (within the pool's min and max).")
    memory_overcommit_ratio: float = Field(0.0, ge=0.0, le=8.0, description="Placement: nominal guest RAM "
                                           "committed on a node may reach its advertised memory times this (1.0 = "
                                           "never over-commit: every guest may touch all its RAM). 0 = no nominal "
                                           "cap: admission by measured use alone (a node that reports no "
                                           "measurement is held to 1.0).")
    memory_headroom_mib: int = Field(1024, ge=0, description="Memory a node keeps free of sandboxes, MiB: it takes "
                                     "a sandbox only while its available memory (MemAvailable less touched guest "
                                     "RAM, which it counts as cache), after the sandboxes in flight and this one, stays above "
                                     "this; and it releases paused and idle sandboxes' RAM when it runs short.")
    memory_sandbox_estimate_mib: int = Field(0, ge=0, description="Host memory a freshly restored sandbox is "
                                             "expected to cost, MiB, for admission; 0 = the node's measured "
                                             "median over its running sandboxes (before one runs: the sandbox's "
                                             "RAM + 64).")
    memory_pressure_idle_s: float = Field(300.0, ge=0, description="Under memory pressure a running sandbox whose "
                                          "lease action is pause and whose guest has been idle (IDLE_CPU_PERCENT) "
                                          "this long may be paused and its RAM released (after every paused "
                                          "one's); 0 = running sandboxes are never paused for memory.")
    vcpu_overcommit_ratio: float = Field(1.0, ge=1.0, le=64.0, description="Placement: vCPUs of running "
                                         "sandboxes on a node may reach its advertised vCPUs times this.")
    placement_candidates: int = Field(2, ge=1, le=64, description="Placement: best of this many random fitting "
                                      "nodes (plus those holding the snapshot or a warm slot).")
    placement_retry_s: float = Field(15.0, ge=0, description="Placement: a create or wake that fits no node is "
                                     "retried every second for this long after its request, so capacity freed "
                                     "meanwhile is used; then it fails with no_capacity (HTTP 503 with Retry-After).")
    pending_timeout_s: float = Field(120.0, gt=0, description="Scheduler: a sandbox still waiting for a node this "
                                     "long after its last change (its place command is gone) is ended: a create "
                                     "fails with placement_timeout, a wake goes back to suspended.")
    pending_check_s: float = Field(5.0, gt=0, description="Scheduler: how often sandboxes waiting for a node past "
                                   "PENDING_TIMEOUT_S are looked for.")
    lease_ttl_s: float = Field(6.0, gt=0, le=300, description="Leader leases (podbay_leases KV bucket): a "
                               "leader that stops renewing loses the lease after this long and a standby "
                               "takes over; renewed every third of it.")
    migrate_host: str = Field("", description="Address this node accepts live-migration streams on (drain); "
                              "empty = node_host.")
    migrate_timeout_s: float = Field(600.0, gt=0, description="Bound on one live migration (RAM and disk).")
    migrate_bandwidth_mib_s: int = Field(1024, ge=1, description="Cap on one migration stream.")
    migrate_max_downtime_ms: int = Field(50, ge=1, description="Stop-and-copy phase QEMU aims for.")
    build_layer_share_s: float = Field(30.0, ge=0, description="Template build layers whose step took at least "
                                       "this long (seconds) are also kept in cache_dir/layers, so other stores "
                                       "on the host (test and CI stacks) reuse them instead of building again.")
    build_layer_cache_gib: float = Field(64.0, gt=0, description="Template build layers a node keeps in its store, "
                                         "GiB: after each build the least recently used go until the rest "
                                         "allocate at most this. Each file counts its allocated blocks, and "
                                         "a layer's reflinked RAM and disk share most extents with its parent "
                                         "and template, so this is an upper bound of their real cost (a "
                                         "layer of base counts about 1 GiB while it holds a few MiB of its own).")
    build_layer_shared_gib: float = Field(32.0, gt=0, description="The same bound for the host's shared layers "
                                          "in cache_dir/layers (BUILD_LAYER_SHARE_S), GiB; copies there are "
                                          "sparse, not reflinks, so the count is close to their cost (the "
                                          "browser's and desktop's slow layers: about 2-2.6 GiB each).")
    oci_allow_device_nodes: bool = Field(False, description="Unpack device nodes (character, block) of images a "
                                         "template is built FROM; off: such an image is refused (the guest's "
                                         "devtmpfs makes /dev, so an image's own nodes serve no purpose).")
    oci_allow_setuid: bool = Field(True, description="Unpack setuid/setgid files and file capabilities of images "
                                   "(sudo, ping inside the guest, a VM of its own; the host never runs an image's "
                                   "file); off: such an image is refused.")
    sandbox_memory_mib: int = Field(256, description="Default guest RAM.")
    sandbox_vcpus: int = Field(1, description="Default guest vCPUs.")
    sandbox_max_disk_mib: int = Field(65536, ge=1, description="Largest root disk a create may ask for "
                                      "(disk_mib), MiB. The disk file is sparse on the node's btrfs store: "
                                      "it costs what the guest writes.")

    # services' own HTTP (health + /metrics)
    health_host: str = Field("127.0.0.1", description="Address the scheduler, snapshotter, warm-pool and gateway "
                             "serve /healthz, /readyz and /metrics on; 0.0.0.0 for Kubernetes probes and "
                             "Prometheus scraping from another host.")
    scheduler_port: int = Field(8091)
    snapshotter_port: int = Field(8092)
    warmpool_port: int = Field(8093)
    gateway_port: int = Field(8095, description="Gateway health and /metrics.")
    metrics_token: str = Field("", description="Bearer token a scraper sends to read /metrics: the API's "
                               "(which also takes an operator tenant's key, and nothing else) and, when set, "
                               "the other services' health ports (anonymous on PODBAY_HEALTH_HOST otherwise).")

    # egress (docs/DESIGN.md §6): every sandbox's traffic is redirected to this node's gateway
    sandbox_cidr: str = Field("", description="This node's sandbox addresses: one /30 per sandbox (tap host side "
                              ".1 = gateway, guest .2). Empty: a /16 of 10.128.0.0/10 chosen once per data directory "
                              "(free on the host) and kept in DATA_DIR/network.json, so stacks side by side never "
                              "share one.")
    gateway_proxy_port: int = Field(8094, description="Gateway's transparent TCP proxy; the node's nftables "
                                    "rules redirect every TCP connection from a sandbox tap here.")
    gateway_dns_port: int = Field(8053, description="Gateway's DNS server; UDP/TCP port 53 from taps lands here.")
    gateway_upstream_ca: Path | None = Field(None, description="Extra CA bundle the gateway trusts for upstream "
                                             "TLS (private services; tests).")
    gateway_hosts_file: Path | None = Field(None, description="hosts(5)-format names the gateway's DNS answers "
                                            "before asking the host's resolver (air-gapped sites; tests).")
    egress_operator_allow_cidrs: str = Field("", description="Operator only (node agent and gateway): "
                                             "comma-separated CIDRs that sandboxes may reach although they lie in "
                                             "an always-denied range (private, CGNAT, link-local, loopback, "
                                             "reserved; docs/egress.md). Tenants' policies never open those "
                                             "ranges; the stack's own addresses stay denied whatever this says.")
    gateway_dns_rate_per_s: float = Field(50.0, gt=0, description="DNS queries per second a sandbox may send the "
                                          "gateway (token bucket); beyond it queries are answered REFUSED.")
    gateway_dns_burst: int = Field(100, ge=1, description="DNS queries a sandbox may send at once before "
                                   "PODBAY_GATEWAY_DNS_RATE_PER_S applies (the token bucket's size).")
    guest_ca_file: Path | None = Field(None, description="PEM file of extra CA certificates every guest trusts "
                                       "(added to its trust store at each create, before the sandbox's own CA): "
                                       "a network that inspects TLS. `podbay up` sets it, when unset, to what the "
                                       "host trusts beyond the public roots; empty = none.")
    gateway_bin: Path | None = Field(None, description="podbay-gateway executable; default: the gateway "
                                     "virtualenv beside this one (.venv-gateway), else beside python.")

    operator_tenant: str = Field("dev", description="The tenant whose keys may change what all tenants share "
                                 "(a template's default egress policy); `podbay up` creates it.")
    quota_sandboxes: int = Field(1000, ge=0, description="Default per-tenant quota: sandboxes that hold a VM "
                                 "or are getting one (pending, starting, running, paused, suspending, "
                                 "resuming); an operator sets a tenant's own (PUT /v1/tenants/{id}/quota).")
    quota_vcpus: int = Field(4000, ge=0, description="Default per-tenant quota: vCPUs of those sandboxes.")
    quota_memory_mib: int = Field(1 << 22, ge=0, description="Default per-tenant quota: guest memory of those "
                                  "sandboxes, MiB.")
    quota_disk_mib: int = Field(1 << 26, ge=0, description="Default per-tenant quota: root disks of those "
                                "sandboxes, MiB (a disk of the template's size counts as that size).")
    quota_builds: int = Field(16, ge=0, description="Default per-tenant quota: template builds running at once.")

    # credentials (docs/DESIGN.md §6)
    credential_backend: Literal["pg", "openbao"] = Field("pg", description="Where credential values live.")
    credential_key: str = Field("", description="pg backend: base64 of the 32-byte AES-256-GCM key that seals "
                                "credential values; the dev stack generates one.")
    openbao_addr: str = Field("", description="openbao backend: server URL, e.g. http://127.0.0.1:8200.")
    openbao_token: str = Field("", description="openbao backend: token with read/write on openbao_mount.")
    openbao_mount: str = Field("secret", description="openbao backend: KV version 2 mount.")

    # workload identity (podbay.oidc): podbay as an OIDC issuer of the tokens the gateway mints
    oidc_issuer: str | None = Field(None, description="Issuer URL of workload identity tokens (their iss); the "
                                    "API serves <issuer>/.well-known/openid-configuration and JWKS, so it must "
                                    "reach the API. Default: http://<api_host>:<api_port>.")
    oidc_token_ttl_s: int = Field(300, ge=30, le=3600, description="Lifetime of a workload identity token the "
                                  "gateway mints per request, seconds.")
    oidc_key_rotate_s: int = Field(86400, ge=900, description="A new signing key after this many seconds "
                                   "(published in the JWKS 10 minutes before it signs); the JWKS lists it, the "
                                   "current and the previous one.")

    log_level: str = Field("INFO")
    log_format: Literal["text", "json"] = Field("text", description="Service logs on stderr: readable text, or "
                                                "one JSON object per line with sandbox/operation/node ids.")

    @field_validator("egress_operator_allow_cidrs")
    @classmethod
    def _cidrs_parse(cls, value: str) -> str:
        parse_cidrs(value)  # raises ValueError naming the bad entry
        return value

    @field_validator("guest_ca_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # ``PODBAY_GUEST_CA_FILE=`` turns off what `podbay up` would otherwise detect; it means no file.
        return None if value == "" else value

    @property
    def logs(self) -> Path:
        """The log directory (``log_dir`` or ``data_dir/logs``)."""
        return self.log_dir or (self.data_dir / "logs")


    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Environment before the TOML file (``PODBAY_CONFIG_FILE``) before defaults."""
        return init_settings, env_settings, _TomlFile(settings_cls)


class _TomlFile(PydanticBaseSettingsSource):
    """Top-level keys of the TOML file named by ``PODBAY_CONFIG_FILE`` (none when unset)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self.path = os.environ.get(CONFIG_FILE_ENV) or None
        self.data = _read_toml(Path(self.path), settings_cls) if self.path else {}

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


def _read_toml(path: Path, settings_cls: type[BaseSettings]) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}: cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path} is not valid TOML: {exc}") from exc
    known = set(settings_cls.model_fields)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        # A typo would otherwise be ignored silently and the default used.
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path}: unknown key(s) {', '.join(unknown)} "
                          "(keys are the setting names in lower case, e.g. nats_url)")
    return data


def load_settings() -> Settings:
    """Read the settings now. Raises :class:`ConfigError` (one line) on a bad file or value."""
    try:
        return Settings()
    except ValidationError as exc:
        where = os.environ.get(CONFIG_FILE_ENV)
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "?"
        raise ConfigError(f"invalid setting {key}: {first['msg']} (from PODBAY_{key.upper()} or "
                          f"{where or 'the defaults'})") from exc


_settings: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, read once from the environment and ``PODBAY_CONFIG_FILE``.
    Raises :class:`ConfigError` on a bad file or value."""
    global _settings
    if _settings is None:
        _settings = load_settings()
    return _settings
