// What the attribute accepts, one case a module (`accepted/*.rs`), built and run as one
// program: trybuild builds and links each program on its own, and every one links the runtime
// again. `crate_path.rs` and `shadowing.rs` stay programs of their own: they name or shadow
// items at the crate root.

#[path = "accepted/any_error_type.rs"]
mod any_error_type;
#[path = "accepted/arguments.rs"]
mod arguments;
#[path = "accepted/async_fn.rs"]
mod async_fn;
#[path = "accepted/control_flow.rs"]
mod control_flow;
#[path = "accepted/free_fn.rs"]
mod free_fn;
#[path = "accepted/generics.rs"]
mod generics;
#[path = "accepted/integer_types.rs"]
mod integer_types;
#[path = "accepted/methods.rs"]
mod methods;
#[path = "accepted/one_line_body.rs"]
mod one_line_body;
#[path = "accepted/parameters.rs"]
mod parameters;
#[path = "accepted/return_types.rs"]
mod return_types;

fn main() {
    any_error_type::main();
    arguments::main();
    async_fn::main();
    control_flow::main();
    free_fn::main();
    generics::main();
    integer_types::main();
    methods::main();
    one_line_body::main();
    parameters::main();
    return_types::main();
}
