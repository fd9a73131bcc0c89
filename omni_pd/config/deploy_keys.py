"""Where a key of a converted deploy file was written, to name it in a problem.

`omni_pd.config.deploy` turns a deploy file into a `stage_args` document and validates that;
the validator's issues name `stage_args[i].engine_args.<key>` in a document nobody wrote.
`DeployKeyMap` renames them to the file and key a user edits: the stage entry
(`stages[stage_id=N].<key>`, in the overlay or a base file), a platform section
(`platforms.<name>.stages[stage_id=N].<key>`), a pipeline-wide top-level key, a connector's
`extra` (code2wav's chunking) or an `edges` entry.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from omni_pd.config.deploy_yaml import DeployDocument, Origin
from omni_pd.config.errors import ConfigIssue


@dataclass
class DeployKeyMap:
    doc: DeployDocument
    stage_ids: tuple[int, ...] = ()  # stage_args index -> stage_id
    # (stage_id, key) -> the platform section that set it (else the stage entry's origin)
    stage_origins: dict[tuple[int, str], Origin] = field(default_factory=dict)
    # (stage_id, engine key) -> ("top", key) | ("connector", name): set from outside the stage
    engine_sources: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)
    edge_index: dict[int, int] = field(default_factory=dict)  # runtime.edges -> the file's edges

    def stage_origin(self, sid: int, key: str) -> Origin:
        return self.stage_origins.get((sid, key)) or self.doc.origin(("stages", sid, key))

    def translate(self, issue: ConfigIssue) -> ConfigIssue:
        key, file, stage_id = issue.key, self.doc.file, issue.stage_id
        match = re.match(r"stage_args\[(\d+)\]\.(.+)$", key)
        if match and self.stage_ids:
            sid = self.stage_ids[int(match[1])]
            file, key = self._stage_location(sid, match[2])
            if not key.startswith(("stages[", "platforms.")):
                stage_id = None  # a top-level key (pipeline-wide setting, connector)
        elif key.startswith("stage_args"):
            key = "stages" + key.removeprefix("stage_args")
        elif key.startswith("runtime.connectors."):
            key = key.removeprefix("runtime.")
            file = self.doc.origin(("connectors", key.split(".")[1])).file
        elif (edge := re.match(r"runtime\.edges\[(\d+)\](.*)$", key)) is not None:
            j = self.edge_index.get(int(edge[1]))
            key = f"edges[{j}]{edge[2]}" if j is not None else "edges"
            file = self.doc.origin(("edges",)).file
        else:
            file = self.doc.origin((re.split(r"[.\[]", key)[0],)).file

        def rename(text: str) -> str:
            return text.replace("runtime.connectors", "connectors")

        return dataclasses.replace(
            issue,
            file=file,
            stage_id=stage_id,
            key=key,
            message=rename(issue.message),
            allowed=None if issue.allowed is None else rename(issue.allowed),
        )

    def _stage_location(self, sid: int, rest: str) -> tuple[str, str]:
        section, _, tail = rest.partition(".")
        first = re.split(r"[.\[]", tail)[0] if tail else ""
        if section == "engine_args" and tail:
            source = self.engine_sources.get((sid, first))
            if source is not None and source[0] == "top":
                return self.doc.origin((first,)).file, tail
            if source is not None and source[0] == "connector":
                return (
                    self.doc.origin(("connectors", source[1])).file,
                    f"connectors.{source[1]}.extra.{tail}",
                )
            origin = self.stage_origin(sid, first)
            return origin.file, origin.stage_key(sid, tail)
        if section == "runtime" and tail:
            if first in ("devices", "env"):
                origin = self.stage_origin(sid, first)
                return origin.file, origin.stage_key(sid, tail)
            origin = self.stage_origin(sid, "runtime")
            return origin.file, origin.stage_key(sid, rest)
        origin = self.stage_origin(sid, re.split(r"[.\[]", rest)[0])
        return origin.file, origin.stage_key(sid, rest)
