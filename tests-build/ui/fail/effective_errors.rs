// A `BatchPlan` needs `effective`, and `effective` needs a `BatchPlan`.
use batch_size_runtime::{find_executable_batch_size, BatchPlan};

#[find_executable_batch_size(starting = 32)]
fn plan_without_effective(plan: BatchPlan) -> usize {
    plan.micro()
}

#[find_executable_batch_size(starting = 32, effective = 256)]
fn effective_with_an_integer(batch_size: usize) -> usize {
    batch_size
}

fn main() {
    let _ = plan_without_effective();
    let _ = effective_with_an_integer();
}
