//! How the engine's device report is shown: one line for startup logs (the server's
//! and the CLI's), and one JSON object for `/props`, `/stats.json` and benchmark output.

use engine::{Device, DeviceReport};
use serde_json::{json, Value};

const GIB: f64 = (1u64 << 30) as f64;

/// `device: NVIDIA H200 [cuda:0], VRAM 20.31 GiB used of 139.81 GiB` (the memory part
/// only when the engine reports it; a CPU report has none).
pub fn line(r: &DeviceReport) -> String {
    let mut s = format!("device: {} [{}]", r.name, r.device);
    match (r.vram_used, r.vram_total) {
        (Some(used), Some(total)) => s.push_str(&format!(
            ", VRAM {:.2} GiB used of {:.2} GiB",
            used as f64 / GIB,
            total as f64 / GIB
        )),
        (Some(used), None) => s.push_str(&format!(", VRAM {:.2} GiB used", used as f64 / GIB)),
        (None, Some(total)) => s.push_str(&format!(", VRAM {:.2} GiB total", total as f64 / GIB)),
        (None, None) => {}
    }
    s
}

/// `cpu` or `cuda`: the kind of executor, without the ordinal.
pub fn kind(d: Device) -> &'static str {
    match d {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
    }
}

/// `{"device": "cuda:0", "kind": "cuda", "ordinal": 0, "name": ..., "vram_used_bytes":
/// n | null, "vram_total_bytes": n | null}`.
pub fn to_json(r: &DeviceReport) -> Value {
    json!({
        "device": r.device.to_string(),
        "kind": kind(r.device),
        "ordinal": match r.device {
            Device::Cpu => Value::Null,
            Device::Cuda(n) => Value::from(n),
        },
        "name": r.name,
        "vram_used_bytes": r.vram_used,
        "vram_total_bytes": r.vram_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> DeviceReport {
        DeviceReport {
            device: Device::Cuda(1),
            name: "NVIDIA H200".into(),
            vram_used: Some(3 << 30),
            vram_total: Some(140 << 30),
        }
    }

    #[test]
    fn line_names_device_and_memory_when_known() {
        assert_eq!(
            line(&gpu()),
            "device: NVIDIA H200 [cuda:1], VRAM 3.00 GiB used of 140.00 GiB"
        );
        let cpu = DeviceReport {
            device: Device::Cpu,
            name: "cpu (avx512)".into(),
            vram_used: None,
            vram_total: None,
        };
        assert_eq!(line(&cpu), "device: cpu (avx512) [cpu]");
        let j = to_json(&cpu);
        assert_eq!(j["device"], "cpu");
        assert!(j["ordinal"].is_null() && j["vram_used_bytes"].is_null());
    }

    #[test]
    fn json_has_ordinal_and_bytes() {
        let j = to_json(&gpu());
        assert_eq!(j["device"], "cuda:1");
        assert_eq!(j["kind"], "cuda");
        assert_eq!(j["ordinal"], 1);
        assert_eq!(j["vram_used_bytes"], 3u64 << 30);
        assert_eq!(j["vram_total_bytes"], 140u64 << 30);
    }
}
