//! The CPU each message cost, from `/proc` (Linux), split by process: the bench process (the
//! consumer), each server's processes, and the whole machine's busy time. It says where the
//! time of a consumer that is slower than the raw one goes.

use crate::measure::median;

/// A server whose CPU a table splits out: its heading, and the name (`comm`, at most 15
/// characters) of its processes. Every process of that name on the machine counts, idle
/// ones too.
pub(crate) type Server = (&'static str, &'static str);

/// CPU time in µs: so far ([`now`](CpuTime::now)), or per message between two readings
/// ([`per_message_since`](CpuTime::per_message_since)).
#[derive(Clone, Copy)]
pub(crate) struct CpuTime<const N: usize> {
    /// The bench process's.
    pub(crate) consumer_micros: f64,
    /// Each server's processes', in the order of the servers given to [`now`](CpuTime::now).
    pub(crate) servers_micros: [f64; N],
    /// The whole machine's busy time.
    pub(crate) machine_micros: f64,
}

/// `/proc` counts in clock ticks, 100 a second on Linux.
const MICROS_PER_TICK: f64 = 10_000.0;

impl<const N: usize> CpuTime<N> {
    /// The CPU time used so far by this process, each of `servers` and the machine.
    pub(crate) fn now(servers: &[Server; N]) -> Self {
        let process = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let consumer = process_ticks(&process);
        let servers = servers.map(|(_, name)| ticks_of_processes_named(name));
        // The first line sums every CPU: user nice system idle iowait irq softirq (then
        // steal, the hypervisor's, left out).
        let machine = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let times: Vec<f64> = machine
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .take(7)
            .filter_map(|field| field.parse().ok())
            .collect();
        let idle = times.get(3).unwrap_or(&0.0) + times.get(4).unwrap_or(&0.0);
        CpuTime {
            consumer_micros: consumer * MICROS_PER_TICK,
            servers_micros: servers.map(|ticks| ticks * MICROS_PER_TICK),
            machine_micros: (times.iter().sum::<f64>() - idle) * MICROS_PER_TICK,
        }
    }

    /// What each message cost of the time used since `earlier`, for `messages` handled.
    pub(crate) fn per_message_since(&self, earlier: &Self, messages: usize) -> Self {
        let per_message = |now: f64, then: f64| (now - then) / messages as f64;
        CpuTime {
            consumer_micros: per_message(self.consumer_micros, earlier.consumer_micros),
            servers_micros: std::array::from_fn(|server| {
                per_message(self.servers_micros[server], earlier.servers_micros[server])
            }),
            machine_micros: per_message(self.machine_micros, earlier.machine_micros),
        }
    }

    /// Each figure's median over `rounds`.
    pub(crate) fn median(rounds: &[Self]) -> Self {
        let of = |value: &dyn Fn(&Self) -> f64| median(rounds.iter().map(value).collect());
        CpuTime {
            consumer_micros: of(&|cpu| cpu.consumer_micros),
            servers_micros: std::array::from_fn(|server| of(&|cpu| cpu.servers_micros[server])),
            machine_micros: of(&|cpu| cpu.machine_micros),
        }
    }
}

/// The CPU per message of each `(consumer, cpu)` row, with a column for each of `servers`,
/// as a Markdown paragraph and table.
pub(crate) fn cpu_table<'a, const N: usize>(
    servers: &[Server; N],
    rows: impl IntoIterator<Item = (&'a str, &'a CpuTime<N>)>,
) -> String {
    let headings: String = servers
        .iter()
        .map(|(heading, _)| format!(" {heading} |"))
        .collect();
    let mut table = format!(
        "CPU per message (medians, µs): the bench process is the consumer; then each server's \
         processes; the whole machine's busy time adds what the kernel and the rest spent.\n\n\
         | consumer | bench process |{headings} whole machine |\n|---|---:|{}---:|\n",
        "---:|".repeat(N)
    );
    for (consumer, cpu) in rows {
        let servers: String = (cpu.servers_micros.iter())
            .map(|micros| format!(" {micros:.0} |"))
            .collect();
        table.push_str(&format!(
            "| {consumer} | {:.0} |{servers} {:.0} |\n",
            cpu.consumer_micros, cpu.machine_micros
        ));
    }
    table
}

/// The paragraph above the [`budget_line`]s under a CPU table.
pub(crate) const BUDGET_HEADING: &str = "\nThe CPU per message each target leaves (the machine's cores × 1 s ÷ the \
     target rate), beside what the row spent at its measured rate:\n\n";

/// A line on what `row`'s target (`at_least` times the raw consumer's `raw_per_second`)
/// leaves each message of the machine's CPU, beside what `cpu` (the row's medians) shows
/// the servers' processes, idle ones included, and the consumer spent at the rate the row
/// reached. Where the servers' part alone is near or above that budget, a cheaper consumer
/// cannot close the gap: the stores' own work per message has to shrink too.
pub(crate) fn budget_line<const N: usize>(
    row: &str,
    at_least: f64,
    raw_per_second: f64,
    cpu: &CpuTime<N>,
) -> String {
    let cores = cores();
    let budget = cores as f64 * 1e6 / (at_least * raw_per_second);
    let servers: f64 = cpu.servers_micros.iter().sum();
    format!(
        "- \"{row}\" at {at_least:.2}× the raw consumer's {raw_per_second:.0} messages a second: \
         {budget:.0} µs per message on {cores} cores. At its measured rate the servers' processes \
         (idle ones included) spent {servers:.0} µs per message, the consumer {:.0}, the whole \
         machine {:.0}.\n",
        cpu.consumer_micros, cpu.machine_micros
    )
}

/// The CPUs `/proc/stat` counts (its `cpuN` lines), over which the whole machine's busy
/// time is read, so that a budget and the machine's figure count the same cores.
fn cores() -> usize {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let count = stat
        .lines()
        .filter(|line| {
            line.strip_prefix("cpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    count.max(1)
}

/// The CPU time, in clock ticks, a process's `/proc/PID/stat` line says it used: past the
/// command name in parentheses, fields 14 and 15 (utime, stime) are the 12th and 13th.
fn process_ticks(stat: &str) -> f64 {
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |index: usize| {
        fields
            .get(index)
            .and_then(|field| field.parse().ok())
            .unwrap_or(0.0)
    };
    ticks(11) + ticks(12)
}

/// The CPU time, in clock ticks, every running process named `name` used so far. A process
/// that ended between two readings takes its time with it: read both while the processes
/// measured live (a server's pool, the connections of the stack measured).
fn ticks_of_processes_named(name: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter(|stat| {
            let comm = stat.split_once('(').and_then(|(_, rest)| rest.rsplit_once(')'));
            comm.is_some_and(|(comm, _)| comm == name)
        })
        .map(|stat| process_ticks(&stat))
        .sum()
}
