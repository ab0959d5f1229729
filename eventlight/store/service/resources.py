"""Resources of ``EventStore``: versioned snapshots published to the log."""

from __future__ import annotations

from eventlight.core.events import ResourcesPut
from eventlight.core.types import (
    NamedResources,
    ResourcesUpdate,
    generate_id,
)
from eventlight.store.service.plumbing import StorePlumbing, store_call
from eventlight.store.validate import (
    check_payload,
    check_resources,
    check_token,
    is_token,
)


class Resources(StorePlumbing):
    """Resources snapshots, versioned per id."""

    # -- resources ------------------------------------------------------------------------------

    async def _put(self, resources_id: str, resources: NamedResources, old: ResourcesUpdate | None) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        check_resources(resources)
        at = self._clock()
        snap = ResourcesUpdate(
            resources_id=resources_id,
            create_time=old.create_time if old else at,
            update_time=at,
            version=old.version + 1 if old else 1,
            resources=dict(resources),
        )
        check_payload("resources", snap)
        self._wrote(await self._log().publish(ResourcesPut(time=at, resources=snap)))
        self._known_resources.add(resources_id)
        return snap

    @store_call
    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return await self._put(generate_id("rs-", 12), resources, None)

    @store_call
    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        check_token("resources_id", resources_id)
        return await self._put(resources_id, resources, await self.get_resources_by_id(resources_id))

    @store_call
    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        if not isinstance(resources_id, str) or not is_token(resources_id):
            return None  # not a subject token: no snapshot can have this id
        return await self._log().resources(resources_id)

    @store_call
    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return await self._log().resources(None)
