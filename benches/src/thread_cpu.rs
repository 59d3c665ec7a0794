//! CPU time of this process's threads by name (Linux `/proc/self/task`): how a backend's own
//! threads behave while nothing moves (an idle progress thread should sleep, not spin).

use std::time::Duration;

/// User plus system CPU time used so far by this process's threads named `name`.
pub fn used(name: &str) -> Duration {
    // SAFETY: sysconf has no memory preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Duration::ZERO };
    let total: u64 = tasks
        .filter_map(|t| t.ok())
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .map(|stat| cpu_ticks(&stat))
        .sum();
    Duration::from_millis(total * 1000 / ticks)
}

/// utime + stime (fields 14 and 15) of a `stat` line; the name field may hold spaces and ')'.
fn cpu_ticks(stat: &str) -> u64 {
    let Some((_, rest)) = stat.rsplit_once(')') else { return 0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state), so field n is f[n - 3].
    let get = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(14) + get(15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines() {
        let line = "42 (a b) c) S 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 1 0";
        assert_eq!(cpu_ticks(line), 280);
        assert_eq!(cpu_ticks("garbage"), 0);
        assert_eq!(cpu_ticks("1 (x) S"), 0);
        assert_eq!(used("no-such-thread-name"), Duration::ZERO);
    }
}
