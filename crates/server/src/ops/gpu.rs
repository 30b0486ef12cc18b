//! The GPU panel's numbers: name, memory used/total and load per device, read
//! from `nvidia-smi` at most once every [`REFRESH`] (the stats page polls
//! twice a second; the query costs tens of milliseconds). A machine without
//! `nvidia-smi` is remembered as having no GPU and never asked again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const REFRESH: Duration = Duration::from_secs(2);
const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

enum Probe {
    Unknown,
    Absent(String),
    Seen { at: Instant, value: Value },
}

static CACHE: Mutex<Probe> = Mutex::new(Probe::Unknown);

fn lock() -> std::sync::MutexGuard<'static, Probe> {
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `{"present": false, "reason": ...}` or `{"present": true, "devices": [...]}`.
pub async fn snapshot() -> Value {
    {
        let g = lock();
        match &*g {
            Probe::Absent(reason) => return json!({"present": false, "reason": reason}),
            Probe::Seen { at, value } if at.elapsed() < REFRESH => return value.clone(),
            _ => {}
        }
    }
    let value = match query().await {
        Ok(devices) if devices.is_empty() => {
            let reason = "nvidia-smi lists no GPU".to_string();
            *lock() = Probe::Absent(reason.clone());
            return json!({"present": false, "reason": reason});
        }
        Ok(devices) => json!({"present": true, "devices": devices}),
        Err(QueryError::Missing(reason)) => {
            *lock() = Probe::Absent(reason.clone());
            return json!({"present": false, "reason": reason});
        }
        // A transient failure: report it, try again after REFRESH.
        Err(QueryError::Failed(reason)) => json!({"present": true, "error": reason, "devices": []}),
    };
    *lock() = Probe::Seen {
        at: Instant::now(),
        value: value.clone(),
    };
    value
}

enum QueryError {
    /// No NVIDIA driver tools on this machine.
    Missing(String),
    Failed(String),
}

async fn query() -> Result<Vec<Value>, QueryError> {
    let mut cmd = tokio::process::Command::new("nvidia-smi");
    cmd.args([
        "--query-gpu=index,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw",
        "--format=csv,noheader,nounits",
    ])
    .kill_on_drop(true)
    .stdin(std::process::Stdio::null());
    let out = match tokio::time::timeout(QUERY_TIMEOUT, cmd.output()).await {
        Err(_) => return Err(QueryError::Failed("nvidia-smi timed out".into())),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(QueryError::Missing("nvidia-smi not found".into()))
        }
        Ok(Err(e)) => return Err(QueryError::Missing(format!("nvidia-smi: {e}"))),
        Ok(Ok(o)) => o,
    };
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let msg = if msg.is_empty() {
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        } else {
            msg
        };
        // nvidia-smi present but no driver / no device: treat as no GPU.
        return Err(QueryError::Missing(format!("nvidia-smi: {msg}")));
    }
    Ok(parse_csv(&String::from_utf8_lossy(&out.stdout)))
}

/// Parses `nvidia-smi --format=csv,noheader,nounits` lines of the query above.
fn parse_csv(text: &str) -> Vec<Value> {
    let num = |s: &str| s.trim().parse::<f64>().ok();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if f.len() < 5 {
                return None;
            }
            Some(json!({
                "index": f[0].parse::<u64>().ok(),
                "name": f[1],
                "memory_used_mib": num(f[2]),
                "memory_total_mib": num(f[3]),
                "utilization_pct": num(f[4]),
                "temperature_c": f.get(5).and_then(|s| num(s)),
                "power_w": f.get(6).and_then(|s| num(s)),
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvidia_smi_lines() {
        let v = parse_csv(
            "0, NVIDIA H200, 1024, 143771, 37, 41, 120.50\n1, NVIDIA H200, [N/A], 143771, 0, 30, [N/A]\n",
        );
        assert_eq!(v.len(), 2);
        assert_eq!(v[0]["name"], "NVIDIA H200");
        assert_eq!(v[0]["index"], 0);
        assert_eq!(v[0]["memory_used_mib"], 1024.0);
        assert_eq!(v[0]["utilization_pct"], 37.0);
        assert_eq!(v[1]["memory_used_mib"], Value::Null);
        assert_eq!(v[1]["power_w"], Value::Null);
    }

    /// On a machine with an NVIDIA GPU (where `nvidia-smi` exists): the probe finds it
    /// and reads its memory. Elsewhere the test says it was skipped.
    #[tokio::test]
    async fn probe_reports_a_gpu() {
        let has_smi = std::process::Command::new("nvidia-smi")
            .arg("-L")
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_smi {
            eprintln!("skipped: no nvidia-smi on this machine (runs on the GPU machine)");
            return;
        }
        let v = snapshot().await;
        println!("{v}");
        assert_eq!(v["present"], true, "{v}");
        let d = &v["devices"][0];
        assert!(d["memory_total_mib"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
        assert!(d["utilization_pct"].is_number(), "{v}");
        // The second call within REFRESH is served from the cache.
        assert_eq!(snapshot().await["devices"][0]["name"], d["name"]);
    }
}
