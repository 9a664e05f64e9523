"""What a real kube-apiserver (v1.28) refuses and fills in on the paths the operator uses, rule
by rule, for the in-process fake (``kube_fake.py``).

Each rule names the API server behaviour it copies, as observed against a v1.28 kube-apiserver
(``tests/operator_live/test_api_conformance.py`` runs the same requests on both tiers and
expects the same answers):

- query parameters are parsed with Go's types: ``timeoutSeconds`` and ``limit`` with
  ``strconv.ParseInt`` (``timeoutSeconds=300.0`` is ``400 BadRequest``, "strconv.ParseInt:
  parsing "300.0": invalid syntax");
- ``metadata.name`` is an RFC 1123 subdomain (at most 253 characters), a namespace's an RFC 1123
  label (at most 63);
- label keys are qualified names (an optional DNS-subdomain prefix, a name part of at most 63
  characters), label values at most 63 bytes of ``[A-Za-z0-9._-]`` starting and ending
  alphanumeric; annotation keys follow the key rule (422 ``Invalid``);
- a Job's name becomes the value of the ``batch.kubernetes.io/job-name`` label of its pod
  template, so a name over 63 characters is refused (422, "spec.template.labels");
- defaulting of the Job, Deployment and StatefulSet fields the operator reads back
  (``completionMode: NonIndexed``, ``backoffLimit: 6``, the selector and pod-template labels of a
  Job, ``strategy`` and ``replicas`` of a Deployment, the pod-template defaults of all three);
- immutable fields: a Job's ``spec.selector``, ``spec.template``, ``spec.completionMode``; a
  Deployment's and a StatefulSet's ``spec.selector`` (422, "field is immutable");
- objects are created only in a namespace that exists (404 "namespaces "x" not found").
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
INTEGER_PARAMS = ("timeoutSeconds", "limit")
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"


class Refusal(Exception):
    """What the API server answers instead of doing the request."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def _parse_int(value: str) -> None:
    """Go's ``strconv.ParseInt(value, 10, 64)``: an optional sign and decimal digits."""
    if not re.fullmatch(r"[+-]?[0-9]+", value):
        raise Refusal(400, "BadRequest", f'strconv.ParseInt: parsing "{value}": invalid syntax')


def check_query(params: Mapping[str, str]) -> None:
    for name in INTEGER_PARAMS:
        if name in params:
            _parse_int(params[name])


def _invalid(kind: str, name: str, field: str, detail: str) -> Refusal:
    return Refusal(422, "Invalid", f'{kind} "{name}" is invalid: {field}: {detail}')


def check_name(kind: str, name: str) -> None:
    pattern, limit, what = (
        (DNS1123_LABEL, 63, "RFC 1123 label")
        if kind == "Namespace"
        else (DNS1123_SUBDOMAIN, 253, "RFC 1123 subdomain")
    )
    if len(name) > limit:
        raise _invalid(kind, name, "metadata.name", f"must be no more than {limit} characters")
    if not pattern.fullmatch(name):
        raise _invalid(
            kind, name, "metadata.name", f'Invalid value: "{name}": a lowercase {what} must '
            "consist of lower case alphanumeric characters, '-' or '.'",
        )  # fmt: skip


def _check_key(kind: str, name: str, field: str, key: str) -> None:
    prefix, _, part = key.rpartition("/")
    if "/" in prefix or (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix))):
        raise _invalid(kind, name, field, f'Invalid value: "{key}": a qualified name is invalid')
    if len(part) > 63:
        raise _invalid(
            kind,
            name,
            field,
            f'Invalid value: "{key}": name part must be no more than 63 characters',
        )
    if not QUALIFIED_NAME.fullmatch(part):
        raise _invalid(kind, name, field, f'Invalid value: "{key}": a qualified name must consist '
                       "of alphanumeric characters, '-', '_' or '.'")  # fmt: skip


def check_labels(kind: str, name: str, labels: Mapping[str, Any], field: str) -> None:
    for key, value in labels.items():
        _check_key(kind, name, field, key)
        text = str(value)
        if len(text) > 63:
            raise _invalid(
                kind, name, field, f'Invalid value: "{text}": must be no more than 63 bytes'
            )
        if not LABEL_VALUE.fullmatch(text):
            raise _invalid(kind, name, field, f'Invalid value: "{text}": a valid label must be '
                           "an empty string or consist of alphanumeric characters, '-', '_' or '.'")  # fmt: skip


def check_metadata(kind: str, obj: Mapping[str, Any]) -> None:
    meta = obj.get("metadata") or {}
    name = str(meta.get("name", ""))
    check_name(kind, name)
    check_labels(kind, name, meta.get("labels") or {}, "metadata.labels")
    for key in meta.get("annotations") or {}:
        _check_key(kind, name, "metadata.annotations", key)
    template = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
    check_labels(kind, name, template.get("labels") or {}, "spec.template.labels")


def _default_image_pull_policy(image: str) -> str:
    """``Always`` for ``:latest`` or an untagged image, else ``IfNotPresent``."""
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _default_pod_spec(spec: dict[str, Any], restart_policy: str) -> None:
    spec.setdefault("restartPolicy", restart_policy)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("terminationGracePeriodSeconds", 30)
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            container.setdefault("imagePullPolicy", _default_image_pull_policy(container["image"]))
            container.setdefault("resources", {})
            for port in container.get("ports") or []:
                port.setdefault("protocol", "TCP")


def apply_defaults(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server stores it: the defaults of the fields the operator reads."""
    out = copy.deepcopy(obj)
    spec = out.get("spec")
    if not isinstance(spec, dict):
        return out
    template = spec.get("template")
    if kind == "Job":
        meta = out["metadata"]
        if not spec.get("completions") and not spec.get("parallelism"):
            spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        uid = meta.get("uid", "")
        if not spec.get("manualSelector"):
            spec.setdefault("selector", {"matchLabels": {CONTROLLER_UID_LABEL: uid}})
            labels = template.setdefault("metadata", {}).setdefault("labels", {})
            labels.setdefault(CONTROLLER_UID_LABEL, uid)
            labels.setdefault(JOB_NAME_LABEL, meta["name"])
            labels.setdefault("controller-uid", uid)
            labels.setdefault("job-name", meta["name"])
        _default_pod_spec(template.setdefault("spec", {}), "Always")
    elif kind == "Deployment":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})
        strategy.setdefault("type", "RollingUpdate")
        if strategy["type"] == "RollingUpdate":
            rolling = strategy.setdefault("rollingUpdate", {})
            rolling.setdefault("maxUnavailable", "25%")
            rolling.setdefault("maxSurge", "25%")
        _default_pod_spec(template.setdefault("spec", {}), "Always")
    elif kind == "StatefulSet":
        spec.setdefault("replicas", 1)
        spec.setdefault("podManagementPolicy", "OrderedReady")
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault(
            "updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
        )
        spec.setdefault(
            "persistentVolumeClaimRetentionPolicy",
            {"whenDeleted": "Retain", "whenScaled": "Retain"},
        )
        _default_pod_spec(template.setdefault("spec", {}), "Always")
    elif kind == "Pod":
        _default_pod_spec(spec, "Always")
    return out


def check_job(obj: Mapping[str, Any]) -> None:
    """A Job's pods must not restart in place (``restartPolicy`` Never or OnFailure)."""
    name = str(obj["metadata"].get("name", ""))
    policy = obj["spec"]["template"]["spec"].get("restartPolicy")
    if policy not in ("Never", "OnFailure"):
        raise _invalid(
            "Job.batch", name, "spec.template.spec.restartPolicy",
            f'Unsupported value: "{policy}": supported values: "OnFailure", "Never"',
        )  # fmt: skip


IMMUTABLE = {
    "Job": ("selector", "template", "completionMode"),
    "Deployment": ("selector",),
    "StatefulSet": ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy"),
}


def check_immutable(kind: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    name = str(old["metadata"].get("name", ""))
    for field in IMMUTABLE.get(kind, ()):
        before = (old.get("spec") or {}).get(field)
        after = (new.get("spec") or {}).get(field)
        if before != after:
            raise _invalid(kind, name, f"spec.{field}", "field is immutable")
