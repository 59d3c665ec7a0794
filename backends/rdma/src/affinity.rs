//! Which NICs suit a region's memory: the NIC on the NUMA node of host memory, the NIC closest
//! on the PCIe tree to the GPU of device memory. Facts come from sysfs (a root passed in, so
//! tests use a made-up tree) and from the kernel (`get_mempolicy`).

use std::path::{Path, PathBuf};

use crate::verbs::NicInfo;

/// Where a region's memory is, as far as NIC choice goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Host memory on this NUMA node (None: unknown).
    Host(Option<u32>),
    /// Device memory of the GPU at this sysfs PCI path (None: unknown).
    Device(Option<String>),
}

/// The NUMA node of the page at `addr` (host memory), if the kernel says.
pub fn numa_node_of(addr: usize) -> Option<u32> {
    if addr == 0 {
        return None;
    }
    let mut node: libc::c_int = -1;
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    // SAFETY: get_mempolicy writes one int into `node` and reads nothing from `addr` (it looks
    // the page up); a null nodemask with maxnode 0 is allowed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &raw mut node,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (r == 0 && node >= 0).then_some(node as u32)
}

/// A NIC's NUMA node and PCI path from sysfs (`ROOT/class/infiniband/DEV/device`).
pub fn nic_topology(sysfs: &Path, device: &str) -> (Option<u32>, Option<String>) {
    let dev = sysfs.join("class/infiniband").join(device).join("device");
    let numa = std::fs::read_to_string(dev.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&n| n >= 0)
        .map(|n| n as u32);
    let pci = std::fs::canonicalize(&dev).ok().map(|p| p.to_string_lossy().into_owned());
    (numa, pci)
}

/// A PCI device's sysfs path from its bus id (`0000:3b:00.0`).
pub fn pci_path(sysfs: &Path, bus_id: &str) -> Option<String> {
    let p: PathBuf = sysfs.join("bus/pci/devices").join(bus_id.to_ascii_lowercase());
    std::fs::canonicalize(p).ok().map(|p| p.to_string_lossy().into_owned())
}

/// Hops between two devices on the PCIe tree: path components of each below their deepest
/// common ancestor (0 for the same device; two devices under one switch port are close, two on
/// different root complexes far).
pub fn pci_distance(a: &str, b: &str) -> usize {
    let (pa, pb): (Vec<&str>, Vec<&str>) = (
        a.split('/').filter(|s| !s.is_empty()).collect(),
        b.split('/').filter(|s| !s.is_empty()).collect(),
    );
    let common = pa.iter().zip(&pb).take_while(|(x, y)| x == y).count();
    (pa.len() - common) + (pb.len() - common)
}

/// The NICs (bit i: `nics[i]`) that suit memory at `place`: on its NUMA node, or closest to its
/// GPU. Every NIC when nothing is known or none matches.
pub fn preferred(nics: &[NicInfo], place: &Placement) -> u64 {
    let all = crate::dispatch::mask_of(nics.len());
    let mask = match place {
        Placement::Host(Some(node)) => nics
            .iter()
            .enumerate()
            .filter(|(_, n)| n.numa_node == Some(*node))
            .fold(0u64, |m, (i, _)| m | (1 << i)),
        Placement::Device(Some(gpu)) => {
            let d: Vec<Option<usize>> =
                nics.iter().map(|n| n.pci_path.as_deref().map(|p| pci_distance(p, gpu))).collect();
            match d.iter().flatten().min() {
                Some(&best) => d
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| **x == Some(best))
                    .fold(0u64, |m, (i, _)| m | (1 << i)),
                None => 0,
            }
        }
        _ => 0,
    };
    if mask == 0 { all } else { mask }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{LinkLayer, NicAddress};

    fn nic(numa: Option<u32>, pci: Option<&str>) -> NicInfo {
        NicInfo {
            address: NicAddress {
                name: "x".into(),
                port: 1,
                lid: 0,
                gid: [0; 16],
                gid_index: 0,
                link: LinkLayer::Ethernet,
                mtu: 5,
                fabric: 0,
            },
            numa_node: numa,
            pci_path: pci.map(str::to_string),
            active: true,
        }
    }

    #[test]
    fn host_memory_prefers_its_numa_node_and_device_memory_the_nearest_nic() {
        let nics = [
            nic(Some(0), Some("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0")),
            nic(Some(1), Some("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0")),
            nic(Some(1), Some("/sys/devices/pci0000:80/0000:80:02.0/0000:82:00.0")),
        ];
        assert_eq!(preferred(&nics, &Placement::Host(Some(1))), 0b110);
        assert_eq!(preferred(&nics, &Placement::Host(Some(7))), 0b111, "no NIC on node 7");
        assert_eq!(preferred(&nics, &Placement::Host(None)), 0b111);
        let gpu = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.1";
        assert_eq!(preferred(&nics, &Placement::Device(Some(gpu.into()))), 0b010);
        assert_eq!(pci_distance(gpu, nics[1].pci_path.as_ref().unwrap()), 2);
        assert_eq!(pci_distance(gpu, nics[0].pci_path.as_ref().unwrap()), 6);
    }

    #[test]
    fn sysfs_facts_are_read_from_the_given_root() {
        let root = std::env::temp_dir().join(format!("tw-sysfs-{}", std::process::id()));
        let real = root.join("devices/pci0000:00/0000:00:02.0/0000:03:00.0");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("numa_node"), "1\n").unwrap();
        let class = root.join("class/infiniband/mlx5_0");
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(&real, class.join("device")).unwrap();
        let (numa, pci) = nic_topology(&root, "mlx5_0");
        assert_eq!(numa, Some(1));
        assert!(pci.unwrap().ends_with("0000:00:02.0/0000:03:00.0"));
        assert_eq!(nic_topology(&root, "absent"), (None, None));
        std::fs::remove_dir_all(&root).unwrap();
        let v = [1u8; 4096];
        // The kernel knows the node of a page we touched (or has no NUMA policy support).
        let _ = numa_node_of(v.as_ptr() as usize);
    }
}
