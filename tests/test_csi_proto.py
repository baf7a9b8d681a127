"""protos/csi.proto is a faithful subset of the CSI spec, and the stubs in csi/ are exactly what it makes.

A CO speaks the spec's csi.proto: any field, number, type or enum value of ours that differs from it is
silently misread on the wire, and a secret the spec marks but we do not would reach the logs. So the
descriptors our stubs register are compared with the spec's own file, compiled from the Go module cache
(where csi-sanity's module puts it), rather than with a copy we could get wrong the same way twice.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2, text_format

from pffs.csi import csi_pb2, csi_pb2_grpc

SPEC_MODULE = "github.com/container-storage-interface/spec"
SPEC_VERSION = "v1.13.0"
REPO = Path(__file__).resolve().parent.parent
GENERATED = tuple(
    f"{proto}{suffix}"
    for proto in ("csi", "pluginregistration")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)
PROTOBUF_INCLUDE = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
# What pffs serves: the servicers implement exactly these, and a CO gets UNIMPLEMENTED for the rest.
SERVED_RPCS = {
    "Identity": ["GetPluginInfo", "GetPluginCapabilities", "Probe"],
    "Controller": ["CreateVolume", "DeleteVolume", "ValidateVolumeCapabilities", "ControllerGetCapabilities"],
    "Node": [
        "NodeStageVolume",
        "NodeUnstageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeGetVolumeStats",
        "NodeGetVolumeHealth",
        "NodeGetCapabilities",
        "NodeGetInfo",
    ],
}
# CI sets this so that a missing spec fails the run instead of skipping the comparison.
REQUIRE_SERVERS = os.environ.get("PFFS_REQUIRE_SERVERS") == "1"


# ------------------------------------------------------------------ the spec's descriptors


def go_module_caches() -> Iterator[Path]:
    """Where `go` keeps modules: $GOMODCACHE, what `go env` says, else the default under $GOPATH or ~/go."""
    if env := os.environ.get("GOMODCACHE"):
        yield Path(env)
    if go := shutil.which("go"):
        try:
            answer = subprocess.run(
                [go, "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            answer = None
        if answer is not None and answer.stdout.strip():
            yield Path(answer.stdout.strip())
    if gopath := os.environ.get("GOPATH"):
        yield Path(gopath.split(os.pathsep)[0]) / "pkg" / "mod"
    yield Path.home() / "go" / "pkg" / "mod"


def find_spec_proto() -> Path | None:
    for cache in go_module_caches():
        candidate = cache / f"{SPEC_MODULE}@{SPEC_VERSION}" / "csi.proto"
        if candidate.is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorProto:
    """The spec's csi.proto as protoc sees it (the same compiler that makes our stubs)."""
    spec_proto = find_spec_proto()
    if spec_proto is None:
        reason = (
            f"csi-sanity's Go module {SPEC_MODULE}@{SPEC_VERSION} is not in the Go module cache "
            "(its csi.proto is what protos/csi.proto is checked against); run make setup"
        )
        if REQUIRE_SERVERS:
            pytest.fail(reason)
        pytest.skip(reason)
    return compile_descriptor(spec_proto, tmp_path_factory.mktemp("spec"))


def compile_descriptor(proto: Path, workdir: Path) -> descriptor_pb2.FileDescriptorProto:
    """A .proto file as protoc sees it (the same compiler that makes our stubs)."""
    descriptor_set = workdir / "descriptors.pb"
    compiled = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto.parent}",
            f"-I{PROTOBUF_INCLUDE}",
            f"--descriptor_set_out={descriptor_set}",
            "--include_imports",
            str(proto),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert compiled.returncode == 0, f"protoc could not compile {proto}:\n{compiled.stderr}"
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    return next(file for file in files if file.name == proto.name)


def our_file() -> descriptor_pb2.FileDescriptorProto:
    """Exactly what csi_pb2 registers at import (so a stale stub is compared, not the .proto)."""
    return descriptor_pb2.FileDescriptorProto.FromString(csi_pb2.DESCRIPTOR.serialized_pb)


# ------------------------------------------------------------------ the comparison


def walk(
    file: descriptor_pb2.FileDescriptorProto,
) -> tuple[dict[str, descriptor_pb2.DescriptorProto], dict[str, descriptor_pb2.EnumDescriptorProto]]:
    """Every message and enum of a file, nested ones included, by full name."""
    messages: dict[str, descriptor_pb2.DescriptorProto] = {}
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}

    def visit(scope: str, nested: list[descriptor_pb2.DescriptorProto], enum_types: list) -> None:
        for enum in enum_types:
            enums[f"{scope}.{enum.name}"] = enum
        for message in nested:
            name = f"{scope}.{message.name}"
            messages[name] = message
            visit(name, list(message.nested_type), list(message.enum_type))

    visit(file.package, list(file.message_type), list(file.enum_type))
    return messages, enums


def options_of(holder: Any) -> str:
    """Every option either side sets (csi_secret, alpha_*, map_entry...), as text a failure can show.

    Parsed again so that extensions read as unknown bytes become named: csi_pb2 has registered them.
    """
    options = type(holder.options).FromString(holder.options.SerializeToString(deterministic=True))
    return text_format.MessageToString(options, as_one_line=True) or "(none)"


def reserved(holder: descriptor_pb2.DescriptorProto | descriptor_pb2.EnumDescriptorProto) -> object:
    return sorted((r.start, r.end) for r in holder.reserved_range), sorted(holder.reserved_name)


def field_shape(message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> dict:
    """What a field must share with the spec's to read the same bytes the same way."""
    oneof = message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
    return {
        "name": field.name,
        "type": descriptor_pb2.FieldDescriptorProto.Type.Name(field.type),
        "type_name": field.type_name,
        "label": descriptor_pb2.FieldDescriptorProto.Label.Name(field.label),
        "oneof": oneof,
        "proto3_optional": field.proto3_optional,
        "default_value": field.default_value,
        "options": options_of(field),
    }


def message_differences(
    name: str, ours: descriptor_pb2.DescriptorProto, spec: descriptor_pb2.DescriptorProto
) -> list[str]:
    problems = []
    our_fields = {field.number: field_shape(ours, field) for field in ours.field}
    spec_fields = {field.number: field_shape(spec, field) for field in spec.field}
    for number in sorted(spec_fields.keys() - our_fields.keys()):
        problems.append(f"message {name}: field {number} ({spec_fields[number]['name']}) is missing")
    for number in sorted(our_fields.keys() - spec_fields.keys()):
        problems.append(f"message {name}: field {number} ({our_fields[number]['name']}) is not in the spec")
    for number in sorted(our_fields.keys() & spec_fields.keys()):
        for key, value in our_fields[number].items():
            if value != spec_fields[number][key]:
                spec_value = spec_fields[number][key]
                problems.append(
                    f"message {name}: field {number} {key} is {value!r}, the spec's {spec_value!r}"
                )
    for what, ours_names, spec_names in (
        ("nested message", {m.name for m in ours.nested_type}, {m.name for m in spec.nested_type}),
        ("nested enum", {e.name for e in ours.enum_type}, {e.name for e in spec.enum_type}),
        ("oneof", {o.name for o in ours.oneof_decl}, {o.name for o in spec.oneof_decl}),
    ):
        if ours_names != spec_names:
            problems.append(f"message {name}: {what}s {sorted(ours_names)}, the spec's {sorted(spec_names)}")
    if reserved(ours) != reserved(spec):
        problems.append(f"message {name}: reserved {reserved(ours)}, the spec's {reserved(spec)}")
    if options_of(ours) != options_of(spec):
        problems.append(f"message {name}: options {options_of(ours)}, the spec's {options_of(spec)}")
    return problems


def enum_differences(
    name: str, ours: descriptor_pb2.EnumDescriptorProto, spec: descriptor_pb2.EnumDescriptorProto
) -> list[str]:
    problems = []
    our_values = {value.name: (value.number, options_of(value)) for value in ours.value}
    spec_values = {value.name: (value.number, options_of(value)) for value in spec.value}
    for value_name in sorted(spec_values.keys() - our_values.keys()):
        problems.append(f"enum {name}: value {value_name} = {spec_values[value_name][0]} is missing")
    for value_name in sorted(our_values.keys() - spec_values.keys()):
        problems.append(f"enum {name}: value {value_name} is not in the spec")
    for value_name in sorted(our_values.keys() & spec_values.keys()):
        (number, options), (spec_number, spec_options) = our_values[value_name], spec_values[value_name]
        if number != spec_number:
            problems.append(f"enum {name}: {value_name} = {number}, the spec's = {spec_number}")
        if options != spec_options:
            problems.append(f"enum {name}: {value_name} options {options}, the spec's {spec_options}")
    if reserved(ours) != reserved(spec):
        problems.append(f"enum {name}: reserved {reserved(ours)}, the spec's {reserved(spec)}")
    if options_of(ours) != options_of(spec):
        problems.append(f"enum {name}: options {options_of(ours)}, the spec's {options_of(spec)}")
    return problems


def service_differences(
    ours: descriptor_pb2.ServiceDescriptorProto, spec: descriptor_pb2.ServiceDescriptorProto
) -> list[str]:
    problems = []
    spec_methods = {method.name: method for method in spec.method}
    for method in ours.method:
        rpc = f"rpc {ours.name}.{method.name}"
        spec_method = spec_methods.get(method.name)
        if spec_method is None:
            problems.append(f"{rpc}: not in the spec")
            continue
        for key in ("input_type", "output_type", "client_streaming", "server_streaming"):
            if getattr(method, key) != getattr(spec_method, key):
                problems.append(
                    f"{rpc}: {key} is {getattr(method, key)!r}, the spec's {getattr(spec_method, key)!r}"
                )
        if options_of(method) != options_of(spec_method):
            problems.append(f"{rpc}: options {options_of(method)}, the spec's {options_of(spec_method)}")
    if options_of(ours) != options_of(spec):
        problems.append(f"service {ours.name}: options {options_of(ours)}, the spec's {options_of(spec)}")
    return problems


def differences(
    ours: descriptor_pb2.FileDescriptorProto, spec: descriptor_pb2.FileDescriptorProto
) -> list[str]:
    """Everything in `ours` that a CSI v1.13.0 peer would read differently; empty when wire-compatible."""
    problems = []
    for key in ("package", "syntax"):
        if getattr(ours, key) != getattr(spec, key):
            problems.append(f"file {key} is {getattr(ours, key)!r}, the spec's {getattr(spec, key)!r}")
    if ours.options.go_package != spec.options.go_package:
        problems.append(f"go_package is {ours.options.go_package!r}, the spec's {spec.options.go_package!r}")
    if extra := sorted(set(ours.dependency) - set(spec.dependency)):
        problems.append(f"imports {extra}, which the spec does not")

    our_messages, our_enums = walk(ours)
    spec_messages, spec_enums = walk(spec)
    for name, message in our_messages.items():
        if name not in spec_messages:
            problems.append(f"message {name}: not in the spec")
        else:
            problems += message_differences(name, message, spec_messages[name])
    for name, enum in our_enums.items():
        if name not in spec_enums:
            problems.append(f"enum {name}: not in the spec")
        else:
            problems += enum_differences(name, enum, spec_enums[name])

    spec_services = {service.name: service for service in spec.service}
    for service in ours.service:
        if service.name not in spec_services:
            problems.append(f"service {service.name}: not in the spec")
        else:
            problems += service_differences(service, spec_services[service.name])

    spec_extensions = {extension.name: extension for extension in spec.extension}
    for extension in ours.extension:
        spec_extension = spec_extensions.get(extension.name)
        if spec_extension is None:
            problems.append(f"extension {extension.name}: not in the spec")
        elif (extension.number, extension.extendee, extension.type, extension.label) != (
            spec_extension.number,
            spec_extension.extendee,
            spec_extension.type,
            spec_extension.label,
        ):
            problems.append(f"extension {extension.name}: {extension}, the spec's {spec_extension}")
    return problems


def test_our_proto_is_a_wire_compatible_subset_of_the_spec(
    spec_file: descriptor_pb2.FileDescriptorProto,
) -> None:
    problems = differences(our_file(), spec_file)
    assert not problems, f"protos/csi.proto differs from the CSI spec {SPEC_VERSION}:\n  " + "\n  ".join(
        problems
    )


def test_our_proto_declares_the_rpcs_pffs_serves() -> None:
    declared = {service.name: [method.name for method in service.method] for service in our_file().service}
    assert declared == SERVED_RPCS


def test_the_comparison_sees_a_change(spec_file: descriptor_pb2.FileDescriptorProto) -> None:
    """Guards the guard: a comparer that finds nothing in a file we broke on purpose proves nothing."""
    broken = our_file()
    messages, enums = walk(broken)
    request = messages["csi.v1.NodePublishVolumeRequest"]
    next(f for f in request.field if f.name == "target_path").number = 40
    next(f for f in request.field if f.name == "secrets").options.Clear()
    del next(m for m in messages["csi.v1.VolumeCapability"].nested_type if m.name == "MountVolume").field[-1]
    next(v for v in enums["csi.v1.VolumeUsage.Unit"].value if v.name == "INODES").number = 3
    broken.service[0].method[0].output_type = ".csi.v1.ProbeResponse"

    found = "\n".join(differences(broken, spec_file))
    for expected in (
        "NodePublishVolumeRequest: field 4 (target_path) is missing",
        "NodePublishVolumeRequest: field 7 options",
        "VolumeCapability.MountVolume: field 3 (volume_mount_group) is missing",
        "VolumeUsage.Unit: INODES = 3",
        "Identity.GetPluginInfo: output_type",
    ):
        assert expected in found, f"{expected!r} not reported; the comparison found:\n{found}"


def secret_fields_at_runtime() -> set[str]:
    """Fields marked [(csi_secret) = true], read the way the servicers' log filter reads them."""
    found: set[str] = set()
    stack = list(csi_pb2.DESCRIPTOR.message_types_by_name.values())
    while stack:
        message = stack.pop()
        stack += message.nested_types
        found |= {f.full_name for f in message.fields if f.GetOptions().Extensions[csi_pb2.csi_secret]}
    return found


def test_every_field_the_spec_marks_secret_is_marked_in_ours(
    spec_file: descriptor_pb2.FileDescriptorProto,
) -> None:
    our_messages, _ = walk(our_file())
    spec_secrets = set()
    for name, message in walk(spec_file)[0].items():
        if name in our_messages:
            for field in message.field:
                options = descriptor_pb2.FieldOptions.FromString(field.options.SerializeToString())
                if options.Extensions[csi_pb2.csi_secret]:
                    spec_secrets.add(f"{name}.{field.name}")
    assert spec_secrets, "the spec marks no field of our messages secret: the extension is not being read"
    our_secrets = secret_fields_at_runtime()
    assert our_secrets == spec_secrets, (
        f"not marked secret in ours: {sorted(spec_secrets - our_secrets)}; "
        f"marked in ours only: {sorted(our_secrets - spec_secrets)}"
    )


# ------------------------------------------------------------------ the generated stubs


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    """The committed stubs are what scripts/gen_protos.sh makes of the committed protos/csi.proto."""
    made = subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, f"scripts/gen_protos.sh failed:\n{made.stderr}"
    stale = [
        name for name in GENERATED if (tmp_path / name).read_bytes() != (REPO / "csi" / name).read_bytes()
    ]
    assert not stale, (
        f"csi/{', csi/'.join(stale)} differ from what protos/csi.proto makes: run scripts/gen_protos.sh"
    )


def test_stubs_carry_the_generated_marker() -> None:
    for name in GENERATED:
        first_line = (REPO / "csi" / name).read_text(encoding="utf-8").splitlines()[0]
        assert first_line.startswith("# Generated by scripts/gen_protos.sh"), f"csi/{name}: {first_line!r}"


def version(text: str) -> tuple[int, ...]:
    """'1.85.1' -> (1, 85, 1); a pre-release tail ('1.86.0rc1') keeps its numeric head."""
    numbers = []
    for piece in text.split("."):
        head = re.match(r"\d+", piece)
        if head is None:
            break
        numbers.append(int(head.group()))
        if head.end() != len(piece):
            break
    return tuple(numbers)


def pinned_versions() -> dict[str, str]:
    """constraints.txt as {normalized name: version} for its `name==version` lines."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[re.sub(r"[-_.]+", "-", name.strip()).lower()] = pinned.strip()
    return pins


def test_installed_grpcio_is_at_least_what_the_stubs_were_generated_for() -> None:
    installed = importlib.metadata.version("grpcio")
    assert version(installed) >= version(csi_pb2_grpc.GRPC_GENERATED_VERSION), (
        f"grpcio {installed} is older than the {csi_pb2_grpc.GRPC_GENERATED_VERSION} "
        "csi_pb2_grpc.py was generated for"
    )


def test_constraints_pin_runtimes_at_or_above_the_generators() -> None:
    """A fresh `make setup` must be able to import the stubs the pinned grpcio-tools makes."""
    pins = pinned_versions()
    for name in ("grpcio", "grpcio-tools", "protobuf"):
        assert name in pins, f"constraints.txt pins no {name}"
    assert version(pins["grpcio"]) >= version(pins["grpcio-tools"]), (
        f"constraints.txt pins grpcio {pins['grpcio']} below grpcio-tools {pins['grpcio-tools']}"
    )
    assert version(pins["grpcio"]) >= version(csi_pb2_grpc.GRPC_GENERATED_VERSION)
    protobuf_gencode = re.search(
        r"^# Protobuf Python Version: (\S+)$", (REPO / "csi" / "csi_pb2.py").read_text(), re.MULTILINE
    )
    assert protobuf_gencode is not None, "csi_pb2.py names no protobuf version"
    assert version(pins["protobuf"]) >= version(protobuf_gencode.group(1)), (
        f"constraints.txt pins protobuf {pins['protobuf']}, below the {protobuf_gencode.group(1)} "
        "csi_pb2.py was generated for"
    )


KUBELET_MODULE, KUBELET_VERSION = "k8s.io/kubelet", "v0.37.2"


def test_our_plugin_registration_proto_matches_the_kubelets(tmp_path: Path) -> None:
    """protos/pluginregistration.proto against the kubelet's own (k8s.io/kubelet, in the Go module cache
    once scripts/build_kube.sh has built the kubelet)."""
    from pffs.csi import pluginregistration_pb2

    found = [
        cache / f"{KUBELET_MODULE}@{KUBELET_VERSION}" / "pkg/apis/pluginregistration/v1/api.proto"
        for cache in go_module_caches()
    ]
    kubelet_proto = next((path for path in found if path.is_file()), None)
    if kubelet_proto is None:
        reason = f"{KUBELET_MODULE}@{KUBELET_VERSION} is not in the Go module cache; run make setup"
        if REQUIRE_SERVERS:
            pytest.fail(reason)
        pytest.skip(reason)
    kubelets = compile_descriptor(kubelet_proto, tmp_path)
    ours = descriptor_pb2.FileDescriptorProto.FromString(pluginregistration_pb2.DESCRIPTOR.serialized_pb)
    problems = differences(ours, kubelets)
    assert not problems, "protos/pluginregistration.proto differs from the kubelet's:\n  " + "\n  ".join(
        problems
    )
    assert {m.name for m in ours.message_type} == {m.name for m in kubelets.message_type}
