"""An in-process Kubernetes API for the operator's live tests: kmock's emulator, made stricter.

kmock 0.8's ``KubernetesEmulator`` stores objects and serves list/watch, but has no uid,
generation or resourceVersion, no ``/status`` subresource, no ``generateName``, no label
selectors, no schema validation, no garbage collection, and merges every write as a dict
update. ``FakeKubeAPI`` keeps kmock's request parsing, discovery, request log and error
rendering, and replaces the object semantics with the API server's:

- ``metadata.uid``, ``creationTimestamp``, ``generation`` (bumped when anything outside
  ``metadata`` and ``status`` changes), ``resourceVersion`` (one counter for all objects);
- PATCH as JSON merge patch (RFC 7386) or JSON patch (RFC 6902); strategic merge patch is
  refused with 415, as the operator must never send it;
- a ``resourceVersion`` in a patch is a precondition: 409 ``Conflict`` when stale;
- for resources with a ``status`` subresource: create and main-resource patches ignore
  ``status``, ``/status`` patches change only ``status``;
- a patch that changes nothing is a no-op: no new resourceVersion, no watch event;
- ``generateName``, finalizers and ``deletionTimestamp``;
- list and watch with ``labelSelector`` (equality, ``!=``, existence); watch from a
  ``resourceVersion`` replays the events after it, ends after ``timeoutSeconds``; a watch
  from before the last ``compact`` gets the 410 ``Expired`` ERROR event;
- ModelDeployment writes are validated against the CRD's OpenAPI schema (jsonschema), 422
  when invalid (CEL rules are not evaluated here: tests/api/test_crd.py pins them);
- the API server's query-parameter parsing, name and label rules, defaulting and immutable
  fields (``kube_rules.py``, each rule with the behaviour it copies);
- namespaces: creating in a missing one is 404, in a terminating one 403; deleting one deletes
  its contents first (the namespace controller);
- garbage collection: an object whose owners (``ownerReferences`` uids) are all gone is
  deleted, finalizers honoured (kube-controller-manager's collector, background propagation).

kmock's path parser reads ``/api/v1/namespaces[/name]`` as the start of a namespaced path, so
``__call__`` parses those two paths itself.

Still not emulated (the real tier, ``KUBEBUILDER_ASSETS``, proves these): schema defaulting
and pruning of custom resources, CEL validation, controllers (Job, Deployment), admission,
RBAC, server-side apply, watch bookmarks.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonschema
import kmock
from kmock._internal import rendering
from modelstage.operator.patch import apply_merge_patch  # RFC 7386, unit-tested there

from support import kube_rules

NAMESPACES_PATH = re.compile(r"/api/v1/namespaces(?:/([^/]+))?/?")
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class ResourceSpec:
    api_version: str
    plural: str
    kind: str
    status: bool = True
    """Whether it has a ``/status`` subresource."""


BUILTIN_RESOURCES = (
    ResourceSpec("v1", "pods", "Pod"),
    ResourceSpec("v1", "events", "Event", status=False),
    ResourceSpec("v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
    ResourceSpec("v1", "namespaces", "Namespace"),
    ResourceSpec("v1", "serviceaccounts", "ServiceAccount", status=False),
    ResourceSpec("batch/v1", "jobs", "Job"),
    ResourceSpec("apps/v1", "deployments", "Deployment"),
    ResourceSpec("apps/v1", "statefulsets", "StatefulSet"),
    ResourceSpec("events.k8s.io/v1", "events", "Event", status=False),
)


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        status=status, reason=reason, message=message, details={"causes": []}
    )


def _refused(refusal: kube_rules.Refusal) -> kmock.KubernetesError:
    return _error(refusal.status, refusal.reason, refusal.message)


def parse_selector(selector: str | None) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e,!f`` -> [(op, key, value)]; set-based forms are refused."""
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise _error(400, "BadRequest", f"set-based selectors are not emulated: {term}")
        if "!=" in term:
            key, value = term.split("!=", 1)
            out.append(("!=", key.strip(), value.strip()))
        elif "==" in term or "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            out.append(("=", key.strip(), value.strip()))
        elif term.startswith("!"):
            out.append(("!", term[1:].strip(), None))
        else:
            out.append(("exists", term, None))
    return out


def selects(selector: list[tuple[str, str, str | None]], labels: Mapping[str, str]) -> bool:
    for op, key, value in selector:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!" and key in labels:
            return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _essence(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class FakeKubeAPI(kmock.KubernetesEmulator):
    """kmock's emulator with the API server's object semantics (see the module docstring)."""

    _specs: dict[kmock.resource, ResourceSpec] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, Any] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    """Watches from a resourceVersion below this are answered 410 Expired (``compact``)."""
    expired_watches: int = attrs.field(default=0, init=False)
    """Watches answered 410 Expired: evidence that a client resumed from forgotten history."""
    _watch_epoch: int = attrs.field(default=0, init=False)
    """Bumped by ``compact``: open watches end, as the API server ends them at their timeout."""

    def register(self, spec: ResourceSpec, *, namespaced: bool = True, schema: Any = None) -> None:
        res = kmock.resource(spec.api_version if "/" in spec.api_version else f"v1/{spec.plural}")
        if "/" in spec.api_version:
            group, version = spec.api_version.split("/")
            res = kmock.resource(group, version, spec.plural)
        else:
            res = kmock.resource("", "v1", spec.plural)
        self._specs[res] = spec
        self.resources[res] = kmock.ResourceInfo(
            kind=spec.kind,
            singular=spec.kind.lower(),
            namespaced=namespaced and spec.plural != "namespaces",
            verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status"} if spec.status else set(),
        )
        if schema is not None:
            self._schemas[res] = schema

    def register_crd(self, crd: Mapping[str, Any]) -> None:
        names = crd["spec"]["names"]
        for version in crd["spec"]["versions"]:
            spec = ResourceSpec(
                f"{crd['spec']['group']}/{version['name']}",
                names["plural"],
                names["kind"],
                status="status" in (version.get("subresources") or {}),
            )
            self.register(
                spec,
                namespaced=crd["spec"]["scope"] == "Namespaced",
                schema=version["schema"]["openAPIV3Schema"],
            )

    # -- request dispatch --------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = NAMESPACES_PATH.fullmatch(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        name = match.group(1)
        query = dict(raw_request.query)
        method = raw_request.method.upper()
        action = (
            kmock.action.WATCH
            if method == "GET" and query.get("watch") in ("true", "1")
            else kmock.action.FETCH
            if method == "GET" and name
            else kmock.action.LIST
            if method == "GET"
            else kmock.action.CREATE
            if method == "POST" and not name
            else kmock.action.UPDATE
            if method == "PATCH" and name
            else kmock.action.DELETE
            if method == "DELETE" and name
            else None
        )
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=query,
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=json.loads(body) if body else None,
            action=action,
            resource=kmock.resource("", "v1", "namespaces"),
            namespace=None,
            name=name,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except rendering.StreamingError as error:
            raise error.__cause__ or error from None
        except Exception as error:
            return await self._render_error(error)

    async def _handle(self, request: rendering.Request) -> Any:
        try:
            kube_rules.check_query(request.params)
        except kube_rules.Refusal as refusal:
            raise _refused(refusal) from None
        # Skip the parent's own state changes: ours happen in the _serve_* callbacks below,
        # which kmock's fallback reactions (registered by the parent) dispatch to.
        return await kmock.KubernetesScaffold._handle(self, request)

    def _spec_of(self, request: rendering.Request) -> ResourceSpec:
        assert request.resource is not None
        spec = self._specs.get(kmock.resource(request.resource))
        if spec is None:
            raise _error(404, "NotFound", f"the server could not find resource {request.resource}")
        return spec

    def _key(self, request: rendering.Request, name: str) -> tuple[kmock.resource, str | None, str]:
        assert request.resource is not None
        return (kmock.resource(request.resource), request.namespace, name)

    def _current(self, key: tuple[kmock.resource, str | None, str]) -> dict[str, Any] | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    async def _emit(self, res: kmock.resource, type_: str, obj: dict[str, Any]) -> None:
        self._log.append((self._rv, res, {"type": type_, "object": copy.deepcopy(obj)}))
        async with self._changed:
            self._changed.notify_all()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _validate(self, res: kmock.resource, obj: Mapping[str, Any]) -> None:
        schema = self._schemas.get(res)
        if schema is None:
            return
        try:
            jsonschema.validate(
                {k: v for k, v in obj.items() if k != "metadata"},
                {
                    **schema,
                    "properties": {
                        k: v for k, v in schema["properties"].items() if k != "metadata"
                    },
                },
            )
        except jsonschema.ValidationError as error:
            path = ".".join(str(p) for p in error.absolute_path)
            raise _error(422, "Invalid", f"{path}: {error.message}") from None

    # -- verbs ---------------------------------------------------------------------------------

    async def _serve_create(self, request: rendering.Request) -> Any:
        spec = self._spec_of(request)
        obj = copy.deepcopy(request.data or {})
        meta = obj.setdefault("metadata", {})
        async with self._lock:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise _error(
                        422, "Invalid", "metadata.name or metadata.generateName is required"
                    )
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            key = self._key(request, meta["name"])
            if self._current(key) is not None:
                raise _error(409, "AlreadyExists", f"{spec.plural} {meta['name']!r} already exists")
            if request.namespace is not None:
                self._check_namespace(spec, request.namespace, meta["name"])
                meta["namespace"] = request.namespace
            if spec.status:
                obj.pop("status", None)
            obj.setdefault("apiVersion", spec.api_version)
            obj.setdefault("kind", spec.kind)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            obj = self._admit(spec, obj)
            meta = obj["metadata"]
            meta["resourceVersion"] = self._next_rv()
            self._validate(key[0], obj)
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._emit(key[0], "ADDED", obj)
        return kmock.Response(status=201, payload=obj)

    async def _serve_update(self, request: rendering.Request) -> Any:
        spec = self._spec_of(request)
        assert request.name is not None
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        async with self._lock:
            key = self._key(request, request.name)
            old = self._current(key)
            if old is None:
                raise _error(404, "NotFound", f"{spec.plural} {request.name!r} not found")
            if content_type == MERGE_PATCH:
                patch = request.data if isinstance(request.data, dict) else {}
                precondition = (patch.get("metadata") or {}).get("resourceVersion")
                new = apply_merge_patch(old, patch)
            elif content_type == JSON_PATCH:
                precondition = None
                try:
                    new = jsonpatch.apply_patch(old, request.data or [])
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                    raise _error(422, "Invalid", f"JSON patch: {error}") from None
            else:
                raise _error(
                    415, "UnsupportedMediaType", f"patch type {content_type!r} is not supported"
                )
            if precondition is not None and str(precondition) != old["metadata"]["resourceVersion"]:
                raise _error(
                    409,
                    "Conflict",
                    f"Operation cannot be fulfilled on {spec.plural} {request.name!r}: the object "
                    "has been modified; please apply your changes to the latest version and try again",
                )
            if request.subresource == "status":
                new = (
                    {**old, "status": new.get("status")}
                    if "status" in new
                    else {k: v for k, v in old.items() if k != "status"}
                )
            elif request.subresource is not None:
                raise _error(404, "NotFound", f"subresource {request.subresource} is not emulated")
            elif spec.status:
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = old["status"]
            # Immutable metadata.
            for field in (
                "uid",
                "creationTimestamp",
                "name",
                "namespace",
                "generation",
                "resourceVersion",
            ):
                if field in old["metadata"]:
                    new.setdefault("metadata", {})[field] = old["metadata"][field]
            if request.subresource is None:
                new = self._admit(spec, new, old)
            if new == old:
                return old  # a no-op: no new version, no event
            if _essence(new) != _essence(old):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._validate(key[0], new)
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self._objects[key].history.append(new)
                self._objects[key].delete()
                await self._emit(key[0], "DELETED", new)
                await self._collect_garbage()
                return new
            self._objects[key].history.append(new)
            await self._emit(key[0], "MODIFIED", new)
            return new

    async def _serve_delete(self, request: rendering.Request) -> Any:
        spec = self._spec_of(request)
        assert request.name is not None
        async with self._lock:
            key = self._key(request, request.name)
            old = self._current(key)
            if old is None:
                raise _error(404, "NotFound", f"{spec.plural} {request.name!r} not found")
            deleted = await self._delete(key, old)
            await self._collect_garbage()
            return deleted

    async def _delete(
        self, key: tuple[kmock.resource, str | None, str], old: dict[str, Any]
    ) -> dict[str, Any]:
        """A DELETE: marked (``deletionTimestamp``) while finalizers remain, else gone. A
        namespace first turns ``Terminating`` and goes when nothing is left in it."""
        if self._specs[key[0]].kind == "Namespace" and not old["metadata"].get("deletionTimestamp"):
            old["metadata"]["deletionTimestamp"] = _now()
            old.setdefault("status", {})["phase"] = "Terminating"
            old["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[key].history.append(old)
            await self._emit(key[0], "MODIFIED", old)
            return old
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                old["metadata"]["deletionTimestamp"] = _now()
                old["metadata"]["resourceVersion"] = self._next_rv()
                self._objects[key].history.append(old)
                await self._emit(key[0], "MODIFIED", old)
            return old
        old["metadata"]["resourceVersion"] = self._next_rv()
        self._objects[key].delete()
        await self._emit(key[0], "DELETED", old)
        return old

    async def _collect_garbage(self) -> None:
        """What kube-controller-manager's garbage collector and namespace controller do, at
        once: an object whose every owner (``ownerReferences`` by uid) is gone is deleted
        (background propagation); a terminating namespace has its contents deleted, and goes
        when they are gone. Repeats until nothing changes (dependents of dependents)."""
        while True:
            live = {k: o.raw for k, o in list(self._objects.items()) if not o.deleted}
            uids = {(obj.get("metadata") or {}).get("uid") for obj in live.values()}
            terminating = {
                k[2] for k, obj in live.items()
                if self._specs[k[0]].kind == "Namespace" and obj["metadata"].get("deletionTimestamp")
            }  # fmt: skip
            doomed = []
            for k, obj in live.items():
                meta = obj.get("metadata") or {}
                owners = meta.get("ownerReferences") or []
                orphaned = bool(owners) and not any(o.get("uid") in uids for o in owners)
                in_terminating = k[1] is not None and k[1] in terminating
                if (orphaned or in_terminating) and not meta.get("deletionTimestamp"):
                    doomed.append(k)
            for namespace in terminating:
                if not any(k[1] == namespace for k in live):
                    doomed.append(next(k for k in live if k[2] == namespace and k[1] is None
                                       and self._specs[k[0]].kind == "Namespace"))  # fmt: skip
            if not doomed:
                return
            for k in doomed:
                obj = copy.deepcopy(live[k])
                if self._specs[k[0]].kind == "Namespace":
                    obj["metadata"]["resourceVersion"] = self._next_rv()
                    self._objects[k].delete()
                    await self._emit(k[0], "DELETED", obj)
                else:
                    await self._delete(k, obj)

    def _check_namespace(self, spec: ResourceSpec, namespace: str, name: str) -> None:
        """Objects go only into a namespace that exists and is not terminating."""
        ns = next(
            (o.raw for (r, _, n), o in self._objects.items()
             if n == namespace and not o.deleted and self._specs.get(r, spec).kind == "Namespace"),
            None,
        )  # fmt: skip
        if ns is None:
            raise _error(404, "NotFound", f'namespaces "{namespace}" not found')
        if ns["metadata"].get("deletionTimestamp"):
            raise _error(
                403, "Forbidden", f'{spec.plural} "{name}" is forbidden: unable to create new '
                f"content in namespace {namespace} because it is being terminated",
            )  # fmt: skip

    def _admit(
        self, spec: ResourceSpec, new: dict[str, Any], old: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Defaulting, then validation of names, labels and immutable fields (``kube_rules``)."""
        try:
            new = kube_rules.apply_defaults(spec.kind, new)
            kube_rules.check_metadata(spec.kind, new)
            if spec.kind == "Job":
                kube_rules.check_job(new)
            if old is not None:
                kube_rules.check_immutable(spec.kind, old, new)
        except kube_rules.Refusal as refusal:
            raise _refused(refusal) from None
        return new

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        spec = self._spec_of(request)
        assert request.name is not None
        async with self._lock:
            obj = self._current(self._key(request, request.name))
        if obj is None:
            raise _error(404, "NotFound", f"{spec.plural} {request.name!r} not found")
        return obj

    def _matching(self, request: rendering.Request) -> Iterable[dict[str, Any]]:
        assert request.resource is not None
        res = kmock.resource(request.resource)
        selector = parse_selector(request.params.get("labelSelector"))
        for (r, namespace, _), obj in list(self._objects.items()):
            if r != res or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = obj.raw
            if selects(selector, (raw.get("metadata") or {}).get("labels") or {}):
                yield copy.deepcopy(raw)

    async def _serve_list(self, request: rendering.Request) -> Any:
        spec = self._spec_of(request)
        async with self._lock:
            items = list(self._matching(request))
            rv = str(self._rv)
        return {
            "apiVersion": spec.api_version,
            "kind": f"{spec.kind}List",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        self._spec_of(request)
        assert request.resource is not None
        res = kmock.resource(request.resource)
        selector = parse_selector(request.params.get("labelSelector"))
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        since = request.params.get("resourceVersion") or ""
        deadline = asyncio.get_running_loop().time() + timeout

        def wanted(event: Mapping[str, Any]) -> bool:
            meta = event["object"].get("metadata") or {}
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                return False
            return selects(selector, meta.get("labels") or {})

        yield b""  # start streaming: headers go out now
        async with self._lock:
            if since.isdigit() and int(since) > 0:
                position = int(since)
                if position < self._compacted:
                    self.expired_watches += 1
                    # The watch cache's answer to a resourceVersion it no longer holds: an
                    # ERROR event with a 410 Status in a 200 stream; the client must re-list.
                    yield {"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "reason": "Expired", "code": 410,
                        "message": f"too old resource version: {position} ({self._compacted})",
                    }}  # fmt: skip
                    return
                backlog = [e for rv, r, e in self._log if rv > position and r == res]
            else:
                # "" or "0": the current state, as ADDED events, then changes.
                backlog = [{"type": "ADDED", "object": o} for o in self._matching(request)]
            seen = len(self._log)
            epoch = self._watch_epoch
        for event in backlog:
            if wanted(event):
                yield event
        while not self._closing and epoch == self._watch_epoch:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            async with self._changed:
                if len(self._log) == seen and not self._closing and epoch == self._watch_epoch:
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                    except TimeoutError:
                        return
            fresh = self._log[seen:]
            seen += len(fresh)
            for _, r, event in fresh:
                if r == res and wanted(event):
                    yield event

    async def compact(self) -> None:
        """Forgets every event so far (as etcd's compaction and the watch cache's window
        do): a watch that resumes from an older resourceVersion gets 410 Expired; open
        watches end, as the API server's do at their timeout."""
        async with self._lock:
            self._compacted = self._rv
        self._watch_epoch += 1
        async with self._changed:
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """Ends every open watch stream (so that the server stops at once)."""
        self._closing = True
        async with self._changed:
            self._changed.notify_all()

    # -- assertions ------------------------------------------------------------------------------

    def writes(self, method: str, path: str, *, agent: str | None = None) -> int:
        """How many ``method`` requests were made to ``path`` (optionally by a User-Agent
        prefix): the operator's behaviour, counted at the server."""
        count = 0
        for request in self._requests:
            if str(request.method.value).upper() != method.upper() or request.url.path != path:
                continue
            if agent is not None and not str(request.headers.get("User-Agent", "")).startswith(
                agent
            ):
                continue
            count += 1
        return count


def new_fake(crds: Iterable[Mapping[str, Any]]) -> FakeKubeAPI:
    api = FakeKubeAPI()
    for spec in BUILTIN_RESOURCES:
        api.register(spec)
    for crd in crds:
        api.register_crd(crd)
    return api
