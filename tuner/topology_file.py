"""A topology file as written: the pydantic model that validates it, and its JSON Schema.

``TopologyFile`` checks each field's type and range and refuses unknown keys, so that an error names the field's
path (``links.intra.bandwidth_GBps: must be greater than 0, got -2``). What pydantic cannot say of one field
alone (a backend the registry lacks, shm across nodes, an inter-node link when there are several nodes, sizes
that must increase, the algorithms each collective may run) is checked after it, with the same kind of path.
``docs/topology.schema.json`` is ``TopologyFile.model_json_schema()``, for an editor to check a file as it is
written.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, WithJsonSchema

from coconet.codegen.backends import BACKENDS
from coconet.errors import TopologyError

# a backend's name: the registry's (coconet.codegen.backends), which coconet.tuner.topology checks a file's
# against, so that a registry with another backend reads files naming it; the schema lists the shipped ones
Backend = Annotated[str, WithJsonSchema({"enum": list(BACKENDS), "type": "string"})]
Collective = Literal["allreduce", "reduce_scatter", "all_gather", "broadcast", "send"]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
# strict: a YAML file gives numbers as numbers, so "1e-5" in quotes or `true` for a count is a mistake to name
_STRICT = ConfigDict(extra="forbid", strict=True)


class LinkFile(BaseModel):
    """One kind of link: α per message step, and its bandwidth (or the seconds per byte it moves)."""

    model_config = _STRICT
    kind: str = Field("", description="What the link is (nvlink, infiniband, loopback, ...), for people.")
    alpha_s: NonNegative = Field(description="Seconds per message step before any byte moves.")
    bandwidth_GBps: Positive | None = Field(None, description="GB/s one step of a ring gets (1 GB = 1e9 B).")
    beta_s_per_byte: Positive | None = Field(None, description="Seconds per byte: instead of bandwidth_GBps.")


class LinksFile(BaseModel):
    model_config = _STRICT
    intra: LinkFile = Field(description="Between ranks of one node.")
    inter: LinkFile | None = Field(None, description="Between nodes; required when nodes > 1.")


class FitFile(BaseModel):
    """A measured collective: ``alpha_s + beta_s_per_byte · n`` for a buffer of n bytes."""

    model_config = _STRICT
    alpha_s: NonNegative
    beta_s_per_byte: NonNegative


class TopologyFile(BaseModel):
    """A machine as figures an α-β cost model needs (docs/tuning.md, "Topologies")."""

    model_config = _STRICT
    name: str
    description: str = ""
    device: Literal["cpu", "cuda"]
    nodes: Annotated[int, Field(gt=0)]
    ranks_per_node: Annotated[int, Field(gt=0)]
    backends: list[Backend] = Field(min_length=1, description="The backends this machine runs.")
    links: LinksFile
    memory_bandwidth_GBps: Positive = Field(description="Per rank, while every rank of the node streams at once.")
    matmul_TFLOPS: dict[str, Positive] = Field(description="Per rank, dense matmul by dtype; float32 required.")
    launch_s: NonNegative = Field(5e-6, description="What a kernel launch or an eager op's dispatch costs.")
    compiled_launch_s: NonNegative | None = Field(None, description="Per call of a compiled kernel; null: launch_s.")
    elementwise_Gops: Positive | None = None
    eager_elementwise_Gops: Positive | None = None
    cache_bytes: Annotated[int, Field(ge=0)] = 0
    cache_bandwidth_GBps: Positive | None = None
    # lax only as far as taking YAML's [bytes, cost] list as a pair; the numbers in it stay strict
    fresh_cost: list[
        Annotated[tuple[Annotated[int, Strict(), Field(gt=0)], Annotated[NonNegative, Strict()]], Strict(False)]
    ] = Field(default_factory=list, description="[bytes, seconds per byte] a fresh buffer costs over a reused one.")
    overlap: Fraction = 1.0
    overlap_memory: Fraction | None = None
    shm_barrier_s: NonNegative = 2e-6
    algorithms: dict[Backend, dict[Collective, list[str] | str]] = Field(default_factory=dict)
    measured: dict[Backend, dict[Collective, FitFile]] = Field(default_factory=dict)
    fingerprint: dict[str, Any] = Field(default_factory=dict, description="The machines a calibration ran on.")


def _where(loc: tuple) -> str:
    """pydantic's location as a field path, ``links.intra.alpha_s`` or ``fresh_cost[1]``; a union's member
    names (``str``, ``list[str]``) and a dict key's ``[key]`` marker are pydantic's, not the file's."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p == "[key]" or (parts and ("[" in p or p in {"str", "int", "float", "none"})):
            continue
        else:
            parts.append(f".{p}")
    return "".join(parts).lstrip(".")


def _message(error: Mapping[str, Any]) -> str:
    if error["type"] == "missing":
        return "is required"
    msg = error["msg"].replace("Input should be", "must be").replace("Value error, ", "")
    return f"{msg}, got {error['input']!r}"


def validate(data: Any, source: str) -> TopologyFile:
    """``data`` (a parsed YAML document) as a ``TopologyFile``; a ``TopologyError`` naming the first bad field."""
    if not isinstance(data, dict):
        raise TopologyError(f"topology {source}: must be a mapping, got {type(data).__name__}", field="")
    try:
        return TopologyFile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(tuple(first["loc"]))
        if first["type"] == "extra_forbidden":
            known = ", ".join(sorted(_model_at(tuple(first["loc"][:-1])).model_fields))
            message = f"unknown field (known: {known})"
        else:
            message = _message(first)
        raise TopologyError(f"topology {source}: {where}: {message}", field=where) from None


def _model_at(loc: tuple) -> type[BaseModel]:
    """The model whose fields an unknown key sits among, for the list of the known ones."""
    nested: dict[tuple, type[BaseModel]] = {
        ("links",): LinksFile,
        ("links", "intra"): LinkFile,
        ("links", "inter"): LinkFile,
    }
    if len(loc) == 3 and loc[0] == "measured":
        return FitFile
    return nested.get(loc, TopologyFile)
