//! What the numbers were measured on, as the report's machine table.

use std::fmt::Write as _;
use std::process::Command;

/// What the numbers were measured on, as a Markdown table: cores, CPU, memory, kernel, and
/// the servers' versions.
pub(crate) fn machine() -> String {
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|line| {
            line.strip_prefix("model name")
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']))
        })
        .unwrap_or("unknown CPU");
    let memory_gib = read("/proc/meminfo")
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.trim().trim_end_matches(" kB").parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut out = String::new();
    let _ = writeln!(out, "| machine | |\n|---|---|");
    let _ = writeln!(
        out,
        "| date (UTC) | {} |",
        first_line("date", &["-u", "+%Y-%m-%d %H:%M"])
    );
    let _ = writeln!(out, "| cores | {cores} |");
    let _ = writeln!(out, "| CPU | {cpu} |");
    let _ = writeln!(out, "| memory | {memory_gib:.0} GiB |");
    let _ = writeln!(out, "| kernel | {} |", read("/proc/sys/kernel/osrelease").trim());
    let _ = writeln!(out, "| Redis | {} |", first_line("redis-server", &["--version"]));
    let _ = writeln!(out, "| PostgreSQL | {} |", first_line("psql", &["--version"]));
    let _ = writeln!(out, "| MariaDB | {} |", first_line("mariadb", &["--version"]));
    let _ = writeln!(out, "| RabbitMQ | {} |", first_line("rabbitmqctl", &["version"]));
    let _ = writeln!(out, "| rustc | {} |", first_line("rustc", &["--version"]));
    out
}

/// The file at `path`, or nothing when it cannot be read (another OS, a sandbox).
fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The first line `program` prints with `args`, trimmed; "unknown" when it does not run or
/// prints nothing.
fn first_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|output| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .filter(|line| !line.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
