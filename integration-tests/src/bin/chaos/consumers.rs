//! The consumer processes, started beside this binary: restarted after each kill, and
//! whenever one dies on its own.

use std::process::{Child, Command, Stdio};

/// The consumer processes: restarted after each kill, and whenever one dies on its own.
pub(crate) struct Consumers {
    processes: Vec<Child>,
    /// The consumer binary, beside this one.
    binary: &'static str,
    args: Vec<String>,
    environment: Vec<(&'static str, String)>,
}

impl Consumers {
    /// Starts `count` processes of the consumer `binary` with `args` and `environment`.
    pub(crate) fn start(
        binary: &'static str,
        args: Vec<String>,
        environment: Vec<(&'static str, String)>,
        count: usize,
    ) -> Self {
        let mut consumers = Consumers {
            processes: Vec::new(),
            binary,
            args,
            environment,
        };
        consumers.processes = (0..count).map(|_| consumers.spawn()).collect();
        consumers
    }

    /// Starts one more process.
    fn spawn(&self) -> Child {
        let binary = std::env::current_exe()
            .expect("the path of this binary")
            .with_file_name(self.binary);
        Command::new(&binary)
            .args(&self.args)
            .envs(self.environment.iter().map(|(name, value)| (name, value)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("{} does not start ({error}); build it first", binary.display()))
    }

    /// SIGKILLs process `index` and starts it again.
    pub(crate) fn kill_and_restart(&mut self, index: usize) {
        let _ = self.processes[index].kill();
        let _ = self.processes[index].wait();
        self.processes[index] = self.spawn();
    }

    /// Restarts every process that has exited since the last look (a poison message's
    /// SIGKILL, or any other crash) and says how many.
    pub(crate) fn restart_exited(&mut self) -> usize {
        let exited: Vec<usize> = (0..self.processes.len())
            .filter(|&index| matches!(self.processes[index].try_wait(), Ok(Some(_))))
            .collect();
        for &index in &exited {
            self.processes[index] = self.spawn();
        }
        exited.len()
    }
}

impl Drop for Consumers {
    fn drop(&mut self) {
        for process in &mut self.processes {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}
