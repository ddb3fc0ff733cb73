"""SGLang plugin entry point (group ``sglang.srt.plugins``), run in every SGLang process.

- ``FAIRBATCHING_CONFIG=<file.toml>`` turns FairBatching on (see ``sglang_ext.adapter.extension_config``).
  Unset: SGLang runs stock; this plugin registers nothing.
- ``FAIRBATCHING_EMULATED_GPU=<profile>`` replaces the model worker with the emulated GPU
  (CPU machines; evaluation and testing only).
- ``FAIRBATCHING_CONTROLPLANE=<rank address>`` with ``FAIRBATCHING_CONTROLPLANE_REPORTS=<report
  address>`` makes the server join a control-plane daemon as one rank per DP rank (needs
  FairBatching on; see ``sglang_ext.adapter.controlplane_agent``).

A bad config stops the process with the reason instead of SGLang silently running stock.
"""

from __future__ import annotations

import logging
import os

from sglang_ext.adapter.controlplane_agent import ControlPlaneConfigError
from sglang_ext.adapter.controlplane_agent import settings_from_environment as controlplane_settings
from sglang_ext.adapter.extension_config import ConfigError, load_from_environment

logger = logging.getLogger("sglang_ext.fairbatching")

EMULATED_GPU_ENV = "FAIRBATCHING_EMULATED_GPU"


def register() -> None:
    emulated_gpu = os.environ.get(EMULATED_GPU_ENV, "").strip()
    if emulated_gpu:
        from sglang_ext.adapter.emulated_gpu import install_emulated_gpu

        install_emulated_gpu(emulated_gpu)
    try:
        config = load_from_environment()
        controlplane = controlplane_settings(fairbatching_on=config is not None)
    except (ConfigError, ControlPlaneConfigError) as exc:
        raise SystemExit(f"FairBatching: {exc}") from None
    if config is None:
        return
    from sglang_ext.adapter.admission import budget_refusal
    from sglang_ext.adapter import hinted_slo
    from sglang_ext.adapter.front_door import install_front_door
    from sglang_ext.adapter.dp_pab import install_dp_pab_hooks
    from sglang_ext.adapter.ingress_time import install_ingress_time
    from sglang_ext.adapter.admission.slo_validation import install_request_validation
    from sglang_ext.adapter.scheduler.hooks import install_scheduler_hooks
    from sglang_ext.adapter.scheduler.router_metrics import install_router_metrics

    install_scheduler_hooks(config)
    install_router_metrics()  # after install_scheduler_hooks
    install_ingress_time()
    install_request_validation(config.catalog, config.build_policy().initial_step_model)
    gate = budget_refusal.install_admission_gate(config)
    hints = config.slo_hints
    install_front_door(  # the hints, then the gate's refusal
        generate=[*([hinted_slo.generate_step(hints)] if hints else []),
                  *([budget_refusal.around_generate] if gate else [])],
        openai=[*([hinted_slo.openai_step(hints)] if hints else []),
                *([budget_refusal.around_openai] if gate else [])])
    install_dp_pab_hooks(config.catalog)
    if controlplane is not None:
        from sglang_ext.adapter.controlplane_agent import install_controlplane_ingress
        from sglang_ext.adapter.scheduler.controlplane_reports import install_controlplane_reports

        install_controlplane_ingress(controlplane)
        install_controlplane_reports(controlplane)  # after install_scheduler_hooks
