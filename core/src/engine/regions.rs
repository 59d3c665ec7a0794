//! The engine's region table: id allocation and the checks every inbound access passes (existence,
//! key, permission, bounds, in that order, so a peer without the key learns nothing about a region).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::backend::RemoteRange;
use crate::error::{Error, Missing, Result};
use crate::ids::RegionId;
use crate::region::{Access, MemSlice, RegionInner, RemoteRegion};

#[derive(Debug)]
pub(crate) struct RegionTable {
    map: RwLock<HashMap<RegionId, Arc<RegionInner>>>,
    next: AtomicU64,
}

impl RegionTable {
    pub(crate) fn new() -> Self {
        Self { map: RwLock::new(HashMap::new()), next: AtomicU64::new(1) }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<RegionId, Arc<RegionInner>>> {
        crate::sync::read(&self.map)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<RegionId, Arc<RegionInner>>> {
        crate::sync::write(&self.map)
    }

    pub(crate) fn next_id(&self) -> RegionId {
        RegionId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn insert(&self, r: Arc<RegionInner>) {
        super::telemetry::region(1.0, r.len);
        self.write().insert(r.id, r);
    }

    pub(crate) fn remove(&self, id: RegionId) {
        let gone = self.write().remove(&id);
        if let Some(r) = gone {
            super::telemetry::region(-1.0, r.len);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.read().len()
    }

    pub(crate) fn advertised(&self) -> Vec<RemoteRegion> {
        let map = self.read();
        let mut v: Vec<_> =
            map.values().filter(|r| r.perms.read || r.perms.write).map(|r| remote_of(r)).collect();
        v.sort_by_key(|r| r.id);
        v.truncate(crate::wire::descriptor::MAX_REGIONS);
        v
    }

    pub(crate) fn remote(&self, id: RegionId) -> Option<RemoteRegion> {
        self.read().get(&id).map(|r| remote_of(r))
    }

    /// Checks an inbound access and returns the guarded slice to copy through.
    pub(crate) fn resolve(&self, range: RemoteRange, access: Access) -> Result<MemSlice> {
        let RemoteRange { region: id, key, offset, len } = range;
        let region = self.read().get(&id).cloned();
        let Some(region) = region else {
            let issued = id.0 >= 1 && id.0 < self.next.load(Ordering::Relaxed);
            return Err(Error::NotFound(if issued {
                Missing::Deregistered(id)
            } else {
                Missing::Region(id)
            }));
        };
        if region.key != key {
            return Err(Error::AccessDenied(format!("region {}: wrong access key", id.0)));
        }
        let granted = match access {
            Access::Read => region.perms.read,
            Access::Write => region.perms.write,
        };
        if !granted {
            return Err(Error::AccessDenied(format!(
                "region {} does not grant remote {}",
                id.0,
                match access {
                    Access::Read => "read",
                    Access::Write => "write",
                }
            )));
        }
        region.slice(offset, len, "remote")
    }
}

fn remote_of(r: &RegionInner) -> RemoteRegion {
    RemoteRegion {
        engine: r.engine_id,
        id: r.id,
        key: r.key,
        len: r.len,
        kind: r.kind,
        perms: r.perms,
        blobs: r.blobs.iter().map(|(n, b)| (n.to_string(), b.clone())).collect(),
    }
}
